"""Where the engine's time goes, phase by phase, summed over its steps.

The engine thread adds to it as it works (a clock read per phase, well under a
microsecond per step), so it is always on; ``llmctl bench throughput --step-profile`` shows
it. Phases, in the order a step runs them:

- schedule: choose the step's sequences and blocks, record the K/V as computed
- inputs: the runner's ``StepBatch`` from the sequences' rows
- model: the runner's ``execute`` (on the GPU only the launch: the device runs on)
- sample: the sampler (launches only, on the GPU)
- wait: waiting for the sampled ids to reach the host (the GPU still computing)
- outputs: append the tokens, check stops, detokenize, build the outputs
- deliver: hand the outputs to the event loops
- idle: nothing to run (no request in flight)

With speculative decoding it also counts the tokens proposed and accepted, by position
(``SpeculationStats``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpeculationStats:
    """Speculative decoding's counts (over the engine's life, or a profile's window):
    verification steps, tokens proposed and accepted, and by position (``accepted_at[j]``: how often the (j+1)-th proposal was accepted,
    out of ``proposed_at[j]``)."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    stopped_requests: int = 0  # requests that stopped proposing (adaptive)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.steps += 1
        self.proposed += num_proposed
        self.accepted += num_accepted
        while len(self.proposed_at) < num_proposed:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for position in range(num_proposed):
            self.proposed_at[position] += 1
            self.accepted_at[position] += position < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def report(self) -> dict:
        return {
            "steps": self.steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_position": [
                accepted / proposed if proposed else 0.0
                for accepted, proposed in zip(self.accepted_at, self.proposed_at)
            ],
            "stopped_requests": self.stopped_requests,
        }


PHASES = ("schedule", "inputs", "model", "sample", "wait", "outputs", "deliver")


@dataclass
class StepProfile:
    steps: int = 0
    scheduled_seqs: int = 0  # summed over steps: the mean batch is this / steps
    schedule: float = 0.0  # seconds, per phase
    inputs: float = 0.0
    model: float = 0.0
    sample: float = 0.0
    wait: float = 0.0
    outputs: float = 0.0
    deliver: float = 0.0
    idle: float = 0.0
    speculation: SpeculationStats = field(default_factory=SpeculationStats)

    def report(self) -> dict:
        """The JSON form: seconds per phase, the step total (idle excluded), the share of
        each phase and the host's share (everything but the model call and the wait), and
        microseconds per scheduled sequence per step, by phase and for the host's work:
        what a larger batch costs the host."""
        busy = sum(getattr(self, phase) for phase in PHASES)
        host = busy - self.model - self.wait
        steps = max(self.steps, 1)
        seqs = max(self.scheduled_seqs, 1)
        return {
            **asdict(self),
            "speculation": self.speculation.report(),
            "mean_batch_seqs": self.scheduled_seqs / steps,
            "step_ms": {phase: getattr(self, phase) * 1000.0 / steps for phase in PHASES},
            "share": {phase: getattr(self, phase) / busy if busy else 0.0 for phase in PHASES},
            "host_share": host / busy if busy else 0.0,
            "seq_us": {phase: getattr(self, phase) * 1e6 / seqs for phase in PHASES},
            "host_seq_us": host * 1e6 / seqs,
        }
