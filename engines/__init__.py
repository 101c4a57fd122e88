"""What runs inside Ray actors. Importing it fixes this process's Ray auth mode first
(engines/process.py): Ray reads it once, when it is imported."""

from engines.process import prepare_ray_auth

prepare_ray_auth()
