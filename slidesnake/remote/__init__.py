"""The remote backend: slide jobs as CPU clients of an inference server (KServe v2)."""
