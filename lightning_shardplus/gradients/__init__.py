"""The gradient sides: what differs between DDP (``ddp/``) and FSDP2 with tensor parallel."""
