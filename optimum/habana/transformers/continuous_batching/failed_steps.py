"""A failed engine step fails the request that caused it, not the others beside it.

transformers' engine runs a step's requests in one forward: when the forward raises, nothing says which request
caused it. Here a failed step of several requests soft resets them all, as the engine's own offloading does (their
cache freed, their tokens so far folded into their prompt, the request requeued under its id, its result reported as
one), and puts them on trial one at a time: a suspect is let into the scheduler alone, and the first step it runs in
decides. A step that fails with the request on trial fails that request; the others of the step are soft reset and go
on. A step of one request fails that request. A suspect whose step runs is cleared and the next one goes on trial.

Requests that are not suspects may share the trial's step (new requests, and those already decoding): a failure
caused by one of them then fails the request on trial. Deterministic failures of one request (its tokens, its
options) are isolated; a failure that depends on the mix of a step is not.
"""

from collections import deque
from typing import Any

from transformers.generation.continuous_batching.requests import RequestState


class StepIsolation:
    """The suspects of failed steps, and the one on trial (`GaudiContinuousBatchingManager`)."""

    def __init__(self) -> None:
        self.suspects: deque[RequestState] = deque()
        self.on_trial: str | None = None

    def step_failed(self, batch_processor: Any, error: Exception) -> list[str]:
        """Deal with a failed step: the ids of the requests it failed (the others are soft reset)."""
        scheduler = batch_processor.scheduler
        states = [future.state for future in batch_processor.inputs_and_outputs.prepare_batch_update()[0]]
        culprit = states[0] if len(states) == 1 else next((s for s in states if s.request_id == self.on_trial), None)
        for state in states:
            if state is culprit:
                batch_processor._handle_request_error(error, state)
                scheduler.finish_request(state.request_id)
                continue
            state.generated_tokens = scheduler.get_active_request_static_outputs(state.request_id)
            requeued = state.create_equivalent_initial_request()
            scheduler.finish_request(state.request_id)  # its cache freed
            if culprit is None:
                self.suspects.append(requeued)
            else:
                scheduler.add_waiting_request(requeued)
        if culprit is not None and culprit.request_id == self.on_trial:
            self.on_trial = None
        self._next_trial(scheduler)
        return [] if culprit is None else [culprit.request_id]

    def step_ran(self, scheduler: Any) -> None:
        """After a step that did not fail: the request on trial is cleared once it has run (it is no longer waiting;
        it may even have finished)."""
        if self.on_trial is not None and self.on_trial not in scheduler.waiting_requests:
            self.on_trial = None
            self._next_trial(scheduler)

    def release_all(self) -> list[RequestState]:
        """The suspects still held, handed back (the manager is stopping: they fail as the scheduler's requests do)."""
        held = list(self.suspects)
        self.suspects.clear()
        return held

    def _next_trial(self, scheduler: Any) -> None:
        if self.on_trial is not None or not self.suspects:
            return
        suspect = self.suspects.popleft()
        scheduler.add_waiting_request(suspect)
        scheduler.waiting_requests_order.remove(suspect.request_id)
        scheduler.waiting_requests_order.appendleft(suspect.request_id)  # the next step's first newcomer
        self.on_trial = suspect.request_id


__all__ = ["StepIsolation"]
