"""What an audit concludes: the verdict, the --fail-on policy and its exit code (:mod:`.policy`), and what changed
since an earlier audit (:mod:`.baseline`)."""
