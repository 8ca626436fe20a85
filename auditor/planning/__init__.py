"""Plans: a compression plan read, resolved and reviewed (:mod:`.plan`), the suggested ranks (:mod:`.suggest`), and
the layer groups both name in globs and tables (:mod:`.groups`). Plain data and arithmetic over the audit's
results: no torch, no tracing."""
