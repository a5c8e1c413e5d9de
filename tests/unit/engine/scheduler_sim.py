"""A model-free harness for the scheduler: requests, a step loop and exact accounting.

`Sim.step` does what `LLMEngine.step` does around the model: schedule, `advance` each
scheduled request, and when a request has computed all its tokens, "sample" a token
(derived from the request and position, so recomputation can be checked) and finish it
once it has `max_tokens` outputs; requests the scheduler ended on their deadline join
`finished` too. After every step the harness checks the block
accounting exactly: each block's reference count equals the number of live requests
(in any state, hand-off ones included) whose block table holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_pool import BlockPool
from engine.cache_share import NO_OWNER, CacheOwner
from engine.finish_reason import FinishReason
from engine.prefix_hash import hash_seed
from engine.priority import Priority
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduled_batch import ScheduledBatch
from engine.scheduler import Scheduler, SchedulerConfig

SEED = hash_seed("m")


def make_req(
    rid: str,
    prompt: list[int] | range,
    max_tokens: int,
    *,
    hold_kv: bool = False,
    seed: int = SEED,
    priority: Priority = Priority.STANDARD,
    deadline: float | None = None,
    owner: CacheOwner = NO_OWNER,
) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(max_tokens=max_tokens),
        hash_seed=seed,
        hold_kv=hold_kv,
        priority=priority,
        deadline=deadline,
        cache_owner=owner,
    )


def token_for(req: Request, index: int) -> int:
    """The 'sampled' token for output position `index`: stable across recomputation."""
    return 1000 + 100 * (sum(map(ord, req.request_id)) % 50) + index


@dataclass
class Sim:
    sched: Scheduler
    finished: list[Request] = field(default_factory=list)
    extra_live: list[Request] = field(default_factory=list)  # blocks held outside the sched
    steps: int = 0

    @property
    def pool(self) -> BlockPool:
        return self.sched.pool

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.sched.add(r)

    def step(self) -> ScheduledBatch:
        sched = self.sched
        batch = sched.schedule()
        self.steps += 1
        for req in batch.expired:
            assert req.finish_reason is FinishReason.DEADLINE and not req.block_ids
            assert req.status is RequestStatus.FINISHED_DEADLINE
        self.finished.extend(batch.expired)
        assert batch.num_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        ids = [id(r) for r, _ in batch.items]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        for req, n in batch.items:
            assert n >= 1
            assert req.status is RequestStatus.RUNNING
            assert req.num_computed_tokens + n <= req.num_tokens
            # The block table covers what this step will write.
            assert len(req.block_ids) * sched.config.block_size >= req.num_computed_tokens + n
        for req, n in batch.items:
            sched.advance(req, n)
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(token_for(req, len(req.output_token_ids)))
                if len(req.output_token_ids) >= req.sampling.max_tokens:
                    sched.finish(req, FinishReason.LENGTH)
                    self.finished.append(req)
        self.check_accounting()
        return batch

    def run(self, max_steps: int = 2000) -> list[ScheduledBatch]:
        batches = []
        while self.sched.has_work():
            assert self.steps < max_steps, "scheduler made no progress"
            batches.append(self.step())
        return batches

    def live(self) -> list[Request]:
        s = self.sched
        held, importing = s.held.values(), s.importing.values()
        return [*s.running, *s.waiting, *held, *importing, *self.extra_live]

    def check_accounting(self) -> None:
        """Each block's refcount == how many live block tables hold it; hashes agree."""
        pool, bs = self.pool, self.sched.config.block_size
        refs = [0] * pool.num_blocks
        for req in self.live():
            assert len(req.block_ids) == len(set(req.block_ids))
            for b in req.block_ids:
                refs[b] += 1
        assert [pool.ref_count(b) for b in range(pool.num_blocks)] == refs
        s = pool.stats()
        assert s.free + s.used == s.total
        assert s.used == sum(1 for r in refs if r)
        for req in self.sched.running:
            # A published block holds exactly the KV its chained hash names.
            for j in range(req.num_computed_tokens // bs):
                h = pool.block_hash(req.block_ids[j])
                assert h is None or h == req.block_hashes[j]

    def assert_no_leaks(self) -> None:
        assert not self.sched.has_work()
        assert not self.sched.running and not self.sched.waiting
        assert not self.sched.held and not self.sched.importing and not self.sched.requests
        assert self.pool.stats().used == 0, self.pool.stats()
        assert all(self.pool.ref_count(b) == 0 for b in range(self.pool.num_blocks))


def make_sim(
    num_blocks: int = 64, block_size: int = 16, max_num_seqs: int = 64, budget: int = 512
) -> Sim:
    cfg = SchedulerConfig(
        block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget
    )
    return Sim(Scheduler(cfg, BlockPool(num_blocks)))


def assert_complete(req: Request) -> None:
    assert req.finish_reason is FinishReason.LENGTH
    assert req.status is RequestStatus.FINISHED_LENGTH or req.hold_kv
    n = req.sampling.max_tokens
    assert req.output_token_ids == [token_for(req, i) for i in range(n)]
    assert req.block_ids == [] or req.hold_kv
