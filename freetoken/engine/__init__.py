"""Requests, KV pool, scheduler, runner (batches -> forward -> sampled tokens) and the LLM API."""
