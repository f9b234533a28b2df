"""DDP's gradient side: communication hooks (compression) and the bucket size and its tuning (fusion)."""
