"""Earlier public import paths, kept for users: each module here is imported under its old name
(``auditor.load``, ``auditor.graph``, ``auditor.layers``, ``auditor.recover``, ``auditor.factorize``,
``auditor.folder``, ``auditor.export``, ``auditor.suggest``) because ``auditor/__init__.py`` adds this folder to the
package's search path, and re-exports, the same objects, the names of the module's new home. Nothing inside the
package imports them (``auditor/__init__.py`` loads ``auditor.factorize`` first: see there)."""
