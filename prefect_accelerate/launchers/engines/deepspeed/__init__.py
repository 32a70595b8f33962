"""DeepSpeed: the plan (torchrun or DeepSpeed's own runner), its hostfile, and the preflight check."""
