"""The device actor: the only code that runs MLX, on one thread of its own.

Every MLX call happens on one dedicated thread (MLX ties streams to the
thread that made them). The thread loads the model, then takes its messages
from a thread-safe mailbox that the actor's Trio task fills as they arrive,
so a plan sent while a step runs is taken the moment the step ends, without
waiting for the event loop (busy writing the last step's tokens to many
streams); the Trio side never blocks on the thread.
Each ``RunStep`` carries a ``StepPlan`` decided by the scheduling core
(``mlxcel/core/scheduler.py``); the executor (``mlxcel/model/executor.py``)
carries it out and the thread queues its ``StepResult`` back to the Trio
loop without waiting. The disk tier's work rides the same plan: its reads
run before the executor gets the plan, its writes are queued after the
step (``mlxcel/disk/device.py`` does both); a plan of writes alone is not a
step, and the executor never sees it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Any

import attrs
import trio

from mlxcel.actors.messages import DeviceMsg, RunStep, UseDiskTier
from mlxcel.core.plan import StepResult
from mlxcel.model.executor import DeviceSettings as DeviceSettings, StepExecutor
from mlxcel.model.info import ModelInfo as ModelInfo

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class DeviceStats:
    num_steps: int


# In the mailbox after the last message: the inbox has ended.
_INBOX_ENDED = object()
# How long the thread waits for a message while disk writes are behind their budget.
DISK_WRITER_POLL_SECONDS = 0.05


class DeviceActor:
    def __init__(self, settings: DeviceSettings, inbox: trio.MemoryReceiveChannel[DeviceMsg]) -> None:
        self._settings = settings
        self.inbox = inbox
        self._num_steps = 0
        self._trio_token: trio.lowlevel.TrioToken | None = None
        # Filled by the actor's task, emptied by the device thread (the only state they share, and thread-safe).
        self._mailbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    async def run(self, *, task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the device thread until its inbox ends; cancellation waits for the thread to finish.

        A dedicated thread rather than Trio's thread cache: a cached worker
        lingers for seconds after its job, holding MLX's per-thread streams,
        and a process that exits meanwhile aborts in MLX's teardown
        ("terminate called without an active exception"). This one ends with
        its loop and is joined here.
        """
        token = self._trio_token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                self._thread_main(task_status)
            except BaseException as error:  # noqa: BLE001 - re-raised in the actor's task
                failure.append(error)
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(finished.set)

        thread = threading.Thread(target=main, name="mlxcel-device", daemon=True)
        with self.inbox:
            thread.start()
            # Shielded: the thread ends when the inbox does, so the forwarding goes on until then.
            with trio.CancelScope(shield=True):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._forward)
                    await finished.wait()
                    nursery.cancel_scope.cancel()  # the thread failed before the inbox ended
            thread.join()
        if failure:
            raise failure[0]

    async def _forward(self) -> None:
        """Move each message to the mailbox as it arrives, then mark the inbox's end."""
        try:
            async for message in self.inbox:
                self._mailbox.put(message)
                # The device thread holds the last reference, so MLX frees a step's released payloads there.
                del message
        finally:
            self._mailbox.put(_INBOX_ENDED)

    def statistics(self) -> DeviceStats:
        return DeviceStats(num_steps=self._num_steps)

    # --- everything below runs on the device thread -------------------------

    def _thread_main(self, task_status: trio.TaskStatus[ModelInfo]) -> None:
        import mlx.core as mx

        from mlxcel.model.kv import StoreFormat, use_store_format
        from mlxcel.model.loader import default_prefill_step_size, load_model

        use_store_format(StoreFormat(self._settings.kv_bits, self._settings.kv_group_size))
        loaded = load_model(self._settings.model_path)
        adapters = None
        if self._settings.lora:
            from mlxcel.model.lora import load_adapters

            adapters = load_adapters(loaded.model, self._settings.lora, apply=self._settings.lora_apply)
        context_size = self._settings.context_size or loaded.family.context_size or 4096
        step = self._settings.prefill_step_size or default_prefill_step_size()
        self._settings = attrs.evolve(self._settings, prefill_step_size=step, context_size=context_size)
        vision = None
        if loaded.vision is not None and loaded.vision.mrope and adapters is not None:
            # mlx-vlm's layers prefill M-RoPE prompts, and the adapters sit in mlx-lm's only.
            loaded = attrs.evolve(loaded, vision=attrs.evolve(
                loaded.vision, refusal="images are not served on this model while LoRA adapters are loaded"))
        if loaded.vision is not None and loaded.vision.refusal is None:
            from mlxcel.vision.encoder import VisionEncoder

            vision = VisionEncoder(loaded.path, loaded.model, mrope=loaded.vision.mrope)
        draft = None
        if self._settings.draft_model_path is not None and self._settings.speculative == "draft":
            from mlxcel.model.draft import load_draft

            draft = load_draft(self._settings.draft_model_path, loaded.tokenizer, prefill_step_size=step)
        worker = StepExecutor(loaded.model, loaded.eos_token_ids, self._settings, loaded.family.model_type,
                             tokenizer=loaded.tokenizer, adapters=adapters, vision=vision, draft=draft)
        info = ModelInfo(
            model_id=loaded.model_id,
            path=loaded.path,
            config=loaded.config,
            family=loaded.family,
            tokenizer=loaded.tokenizer,
            chat_template=loaded.chat_template,
            eos_token_ids=frozenset(loaded.eos_token_ids),
            context_size=context_size,
            prefill_step_size=step,
            bucket_starts=worker.bucket_starts,
            adapters=adapters.infos if adapters is not None else (),
            vision=loaded.vision,
        )
        wanted = self._settings.warm_up
        if mx.default_device() != mx.cpu if wanted is None else wanted:
            from mlxcel.model.warm_up import warm_up

            logger.info("device warm-up took %.2f s", warm_up(worker, info))
        trio.from_thread.run_sync(task_status.started, info, trio_token=self._trio_token)
        disk: Any = None  # disk/device.py's DeviceDisk, once the engine hands over a disk tier
        trio_token = self._trio_token
        assert trio_token is not None, "set by run() before the thread starts"
        try:
            while True:
                message = self._receive(disk)
                if message is _INBOX_ENDED:
                    return
                match message:
                    case None:
                        continue
                    case RunStep():
                        reply_to, disk_writes = message.reply_to, message.plan.disk_writes
                        done = self._run_step(worker, disk, message.plan)
                        # The released payloads die here, so MLX frees them on this thread; before the
                        # reply, so that nothing the scheduler does on it can find them still held.
                        del message
                        # Queued, not awaited: the device goes on to the next step at once (the reply
                        # channel is the step's own, and Trio runs queued callbacks in order).
                        with contextlib.suppress(trio.RunFinishedError):
                            trio_token.run_sync_soon(_reply, reply_to, done)
                        worker.after_reply()
                        if disk is not None:
                            disk.queue(disk_writes)  # behind the step, converted when idle
                        del reply_to, disk_writes, done
                    case UseDiskTier():
                        from mlxcel.disk.device import DeviceDisk

                        disk = DeviceDisk(message.tier, worker.num_layers, worker.family)
                        del message
                    case _:
                        raise AssertionError(f"unexpected device message {message!r}")
        finally:
            if disk is not None:
                disk.flush()
            # Work queued without a wait (donation copies) ends before the thread does.
            with contextlib.suppress(Exception):
                mx.synchronize()

    def _run_step(self, worker: StepExecutor, disk: Any, plan: Any) -> StepResult:
        """The plan's disk reads, then the step; a plan of disk writes alone runs nothing."""
        if plan.only_writes:
            return StepResult(step_number=self._num_steps)
        from mlxcel.disk.device import read_starts

        plan, reads = read_starts(disk, plan, worker.prefill_seconds_per_token)
        done = worker.run_step(plan)
        self._num_steps = done.step_number
        return attrs.evolve(done, disk_reads=reads) if reads else done

    def _receive(self, disk: Any) -> Any:
        """The next message (or ``_INBOX_ENDED``); with disk writes queued, None after converting a slice of them
        when none waits."""
        if disk is None or not disk.has_work():
            return self._mailbox.get()
        try:
            return self._mailbox.get_nowait()
        except queue.Empty:
            pass
        if disk.can_work():
            disk.work()
            return None
        # The writer is behind (its write budget): wait for a message a little, then look again.
        try:
            return self._mailbox.get(timeout=DISK_WRITER_POLL_SECONDS)
        except queue.Empty:
            return None


def _reply(reply_to: trio.MemorySendChannel[Any], done: Any) -> None:
    # The scheduler may have gone away (shutdown).
    with reply_to, contextlib.suppress(trio.BrokenResourceError, trio.WouldBlock):
        reply_to.send_nowait(done)
