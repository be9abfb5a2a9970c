"""NeMo speechlm2 SALM checkpoints read without NeMo: the checkpoint and its adapter (salm), its audio front end
(audio)."""
