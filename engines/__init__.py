"""What runs inside Ray actors. Importing it fixes this process's Ray auth mode first
(engines/ray_auth.py): Ray reads it once, when it is imported."""

from engines.ray_auth import prepare_ray_auth

prepare_ray_auth()
