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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

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

    def report(self) -> dict:
        """The JSON form: seconds per phase, the step total (idle excluded), the share of
        each phase and the host's share (everything but the model call and the wait)."""
        busy = sum(getattr(self, phase) for phase in PHASES)
        host = busy - self.model - self.wait
        steps = max(self.steps, 1)
        return {
            **asdict(self),
            "mean_batch_seqs": self.scheduled_seqs / steps,
            "step_ms": {phase: getattr(self, phase) * 1000.0 / steps for phase in PHASES},
            "share": {phase: getattr(self, phase) / busy if busy else 0.0 for phase in PHASES},
            "host_share": host / busy if busy else 0.0,
        }
