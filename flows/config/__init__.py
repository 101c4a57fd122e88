"""The run config as the driver builds it, once, before any actor sees it: the sections
composed (run.py), loaded from YAML with overrides (loader.py), local paths made absolute
(paths.py), storage credentials gathered (storage_credentials.py), and the warning when a
replay trains under a changed config (history.py)."""
