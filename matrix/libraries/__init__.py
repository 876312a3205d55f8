"""Support for one training library that more than one engine uses, in one public module each:
accelerate's process-wide state (the accelerate, hf-trainer and accelerate-fsdp2 engines), the
transformers Trainer's harness side (hf-trainer, hf-trainer-zero2/3), DeepSpeed's config and
views of its engine (deepspeed-zero0..3, hf-trainer-zero2/3)."""
