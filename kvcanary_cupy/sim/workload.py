"""The synthetic workload: what requests look like (:class:`WorkloadShape`) and the requests of one run
(:class:`RequestSpec`, drawn once by :func:`make_workload`, every token included, so the engine always knows
the ground truth a correct step must reproduce)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkloadShape:
    """How requests look. Lengths are inclusive ``(low, high)`` ranges of tokens."""

    system_prompts: int = 4  # shared prefixes ("system prompts") that many requests start with
    system_len: tuple[int, int] = (16, 64)
    p_system: float = 0.6  # probability that a request starts with a system prompt
    p_followup: float = 0.2  # probability that a request continues an earlier one (multi-turn)
    # > 0: a follow-up continues a conversation that arrived at least this many steps earlier and leaves room
    # for its own turn (a user coming back after the engine moved on); 0: any earlier one, dropped if too long
    followup_age: int = 0
    suffix_len: tuple[int, int] = (8, 96)  # request-specific part of the prompt
    output_len: tuple[int, int] = (8, 64)  # tokens generated
    arrival_fraction: float = 0.6  # requests arrive during the first fraction of the steps
    max_total_len: int = 768
    vocab: int = 32000


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload: its prompt followed by the tokens the engine will sample."""

    rid: int
    arrival: int
    tokens: np.ndarray  # int64 [total_len]
    prompt_len: int

    @property
    def total_len(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def output_len(self) -> int:
        return self.total_len - self.prompt_len


REFERENCE_STEPS = 200  # the shapes' output lengths are for runs this long; shorter runs get shorter outputs


def make_workload(shape: WorkloadShape, num_requests: int, steps: int, rng: np.random.Generator) -> list[RequestSpec]:
    """Draw ``num_requests`` requests arriving over the first ``arrival_fraction`` of ``steps``. Output lengths
    shrink with runs shorter than :data:`REFERENCE_STEPS`, so that requests finish, rows get recycled and the
    prefix cache fills even in a short run."""
    scale = min(1.0, max(0.1, steps / REFERENCE_STEPS))
    out_lo, out_hi = shape.output_len
    output_len = (max(1, round(out_lo * scale)), max(2, round(out_hi * scale)))

    def draw(bounds: tuple[int, int]) -> int:
        return int(rng.integers(bounds[0], bounds[1] + 1))

    def tokens(n: int) -> np.ndarray:
        return rng.integers(1, shape.vocab, size=n, dtype=np.int64)

    systems = [tokens(draw(shape.system_len)) for _ in range(max(1, shape.system_prompts))]
    last_arrival = max(1, int(steps * shape.arrival_fraction))
    arrivals = np.sort(rng.integers(0, last_arrival, size=num_requests))
    specs: list[RequestSpec] = []
    for rid, arrival in enumerate(arrivals.tolist()):
        suffix = tokens(draw(shape.suffix_len))
        output = tokens(max(1, draw(output_len)))
        roll = rng.random()
        head = np.empty(0, np.int64)
        if specs and roll < shape.p_followup and shape.followup_age:
            room = shape.max_total_len - suffix.shape[0] - output.shape[0]
            earlier = [s for s in specs if s.arrival <= arrival - shape.followup_age and s.total_len <= room]
            if earlier:
                head = earlier[int(rng.integers(len(earlier)))].tokens
        elif specs and roll < shape.p_followup:
            head = specs[int(rng.integers(len(specs)))].tokens  # the whole earlier conversation
        elif roll < shape.p_followup + shape.p_system:
            head = systems[int(rng.integers(len(systems)))]
        if head.shape[0] + suffix.shape[0] + output.shape[0] > shape.max_total_len:
            head = np.empty(0, np.int64)
        prompt = np.concatenate([head, suffix])
        if prompt.shape[0] < 2:
            prompt = np.concatenate([prompt, tokens(2)])
        room = shape.max_total_len - prompt.shape[0]
        output = output[: max(1, room)]
        specs.append(RequestSpec(rid, int(arrival), np.concatenate([prompt, output]), int(prompt.shape[0])))
    return specs
