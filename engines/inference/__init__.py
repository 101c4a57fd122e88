"""The embedded inference engine: a PyTorch/transformers generator (KV-cache decode, compiled
step in csrc/), its scheduler, and the HTTP server that speaks SGLang's protocol, run as an
engine actor. Nothing here knows about rollouts."""
