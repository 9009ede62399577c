"""The embedded backend's engine: classifier forward, GDN kernels, fused pieces, warm-up."""
