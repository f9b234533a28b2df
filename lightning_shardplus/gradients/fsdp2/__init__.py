"""FSDP2 and tensor parallel's gradient side: the stand-in step of a rank without data, a window's gradients kept
across a checkpoint, and the launcher that gathers the weights whole for the launching process."""
