"""TileLang kernels, each beside a plain torch reference of the same signature (see dispatch.get_op)."""
