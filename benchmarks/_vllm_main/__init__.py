"""The helpers of ``benchmarks/vllm_main_pipeline.py``: main's modules with vLLM stubbed, and one stage process."""
