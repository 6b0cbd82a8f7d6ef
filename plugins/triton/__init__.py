"""Our engine behind NVIDIA Triton Inference Server (`mqa-triton`): docs/deployment.md."""
