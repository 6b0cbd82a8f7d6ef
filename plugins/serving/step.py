"""What the scheduler and the model runner say to each other, once per engine step (vLLM's
SchedulerOutput / ModelRunnerOutput): the scheduler decides a `SchedulerOutput`, the runner (in this
process, or in every tensor-parallel rank: these are pickled as they are) executes it and answers a
`StepResult`, and the scheduler applies that."""

from __future__ import annotations

from dataclasses import dataclass, field

from plugins.serving.request import Request


@dataclass
class RunnerInfo:
    """What a model runner holds from its start, per rank: the KV pool's bytes (a draft model's K and V
    are pool tensors too) and what one prompt token's K and V take outside the pool."""

    pool_bytes: int
    draft_bytes: int
    token_bytes: int
    speculative: bool  # the engine proposes tokens (prompt lookup or a draft model)
    # one forward computes every chunk of a step (`BatchDecoder.fuses_chunks`), so a chunk can start from
    # columns another chunk of the same step computes (SchedulerOutput.share)
    fuses_chunks: bool = False


@dataclass
class Admission:
    """A request that takes a slot this step. Its prompt is prefilled in `fill`: the id of the first
    request admitted with the same prompt (n choices share one prefill)."""

    request: Request
    fill: int


@dataclass
class SchedulerOutput:
    evict: list[int] = field(default_factory=list)        # prefix-cache entries to drop, first
    release: list[int] = field(default_factory=list)      # requests that leave (cancelled, stopped by text)
    admit: list[Admission] = field(default_factory=list)  # requests that take a slot
    # fill -> (prefix-cache entry, its first tokens): a fill's first chunk starts from a copy of them
    reuse: dict[int, tuple[int, int]] = field(default_factory=dict)
    chunks: dict[int, int] = field(default_factory=dict)  # fill -> the prompt column its prefill reaches now
    keep: dict[int, tuple[int, int]] = field(default_factory=dict)  # completed fill -> (new entry, its tokens)
    # fill -> (a fill ahead of it in `chunks`, its first columns): the fill's first chunk starts from those
    # columns as the other one's chunk computes them in this same forward (a prefix neither had cached)
    share: dict[int, tuple[int, int]] = field(default_factory=dict)
    speculate: bool = False                               # decode rows may verify proposed tokens


@dataclass
class DecodeReading:
    """The decode phase of a step, for the speculation policy: rows, whether it verified proposals,
    tokens made, seconds (less what a draft spent catching up: the cost of probing, not of speculating)."""

    rows: int
    verified: bool
    tokens: int
    seconds: float


@dataclass
class StepResult:
    tokens: dict[int, list[int]] = field(default_factory=dict)   # request -> tokens made this step
    finished: dict[int, str] = field(default_factory=dict)       # request -> "stop" | "length"
    failed: dict[int, str] = field(default_factory=dict)         # request -> why (it ended alone)
    failed_fills: list[int] = field(default_factory=list)        # fills whose prefill raised (requests in `failed`)
    logprobs: dict[int, list] = field(default_factory=dict)      # request -> (logprob, top k) per new token
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # request -> the same per prompt token
    prompt_tokens: int = 0                                       # prompt tokens computed this step
    seconds: dict[str, float] = field(default_factory=dict)      # "prefill" / "decode" / "mixed" (both in one forward)
    decode: DecodeReading | None = None
    speculation: dict | None = None                              # cumulative: steps, drafted, accepted
