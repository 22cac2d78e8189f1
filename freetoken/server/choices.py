"""n > 1: one engine request per choice, the later ones submitted once the first one's prompt is
in the prefix cache (scheduler.cache_prompt runs when a prefill ends), so the prompt is computed
once. With a seed, choice i uses seed + i so the choices differ yet stay reproducible."""
from __future__ import annotations

import asyncio
from dataclasses import replace

from freetoken.server.generation import Generation, GenSpec, Usage


def fan_out(state, spec: GenSpec, route: str, rid: str, n: int) -> list[Generation]:
    first = Generation(state, spec, route, rid)
    rest = []
    for i in range(1, n):                 # prompt logprobs are the same for every choice: the first has them
        params = replace(spec.params, prompt_logprobs=None,
                         seed=None if spec.params.seed is None else spec.params.seed + i)
        rest.append(Generation(state, replace(spec, params=params), route, f"{rid}-{i}", after=first.started))
    return [first, *rest]


async def merged(gens: list[Generation]):
    """(choice index, event) from every generation as they come; leaving early cancels them all
    (each one's own clean-up then aborts its request and frees its KV)."""
    queue: asyncio.Queue = asyncio.Queue()
    END = object()

    async def pump(i, gen):
        try:
            async for ev in gen.events():
                await queue.put((i, ev))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((i, e))
        finally:
            await queue.put((i, END))
    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            i, ev = await queue.get()
            if ev is END:
                running -= 1
            elif isinstance(ev, Exception):
                raise ev
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_all(gens: list[Generation]) -> list:
    """Every choice's Collected (concurrently); the first failure cancels the rest."""
    tasks = [asyncio.ensure_future(g.collect()) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(usages: list[Usage]) -> Usage:
    """The prompt counted once (as OpenAI bills n > 1), completions summed; cached tokens are
    the first choice's (the later ones reuse what it computed, not what was cached before)."""
    return Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages), usages[0].cached_tokens)
