"""User hooks: a Protocol per extension point (protocols.py) and the loader that imports a
hook from its import string and checks it against its Protocol at start-up (loader.py)."""
