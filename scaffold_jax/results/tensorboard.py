"""A record sink that writes TensorBoard event files (tensorboardX, the optional
``tensorboard`` extra): :class:`TensorBoardSink`."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"  # the run folder's event files


class TensorBoardSink:
    """A record sink that writes every numeric field of each record as a TensorBoard
    scalar (tag: the field name, under the record's series when there are several;
    step: the record's ``round``), flushed per record, into ``<folder>/tensorboard``.

    It uses tensorboardX (the optional ``tensorboard`` extra; no TensorFlow needed).
    Pass it as (or call it from) the ``callback=`` of ``Simulation.run`` / ``loop.run``.

    Raises:
      ImportError: tensorboardX is not installed (the message says how to get it).
    """

    def __init__(self, folder: str | os.PathLike, series_prefix: bool = False):
        try:
            from tensorboardX.event_file_writer import EventsWriter
        except ImportError as err:
            raise ImportError(
                "--tensorboard needs tensorboardX: pip install 'scaffold-jax[tensorboard]'"
            ) from err
        self.directory = Path(folder) / TENSORBOARD_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.series_prefix = series_prefix
        # tensorboardX's synchronous events writer: its SummaryWriter queues events for a
        # background thread, whose flush() does not wait for them, so a killed run would
        # lose the last ones.
        # The nanoseconds make the file name unique (tensorboardX names it by the second:
        # a second sink in the same second would overwrite the first) and keep files in
        # the order they were written, which is the order TensorBoard reads them in.
        self._events = EventsWriter(
            str(self.directory / "events"), filename_suffix=f".{time.time_ns()}"
        )

    def __call__(self, record: Mapping[str, Any]) -> None:
        from tensorboardX.proto import event_pb2, summary_pb2

        step = int(record["round"])
        prefix = f"{record['series']}/" if self.series_prefix and "series" in record else ""
        values = [
            summary_pb2.Summary.Value(tag=prefix + name, simple_value=float(value))
            for name, value in record.items()
            if name != "round" and isinstance(value, (int, float)) and not isinstance(value, bool)
        ]
        summary = summary_pb2.Summary(value=values)
        self._events.write_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        self._events.flush()

    def purge_from(self, step: int) -> None:
        """Tells TensorBoard to drop the events of step >= ``step`` written before this
        call (a ``SessionLog.START`` event, what ``SummaryWriter(purge_step=)`` writes):
        a run resumed from its checkpoint at round R re-runs rounds R+1, ... whose
        records the interrupted process may already have written."""
        from tensorboardX.proto import event_pb2

        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._events.write_event(
            event_pb2.Event(wall_time=time.time(), step=int(step), session_log=start)
        )
        self._events.flush()

    def close(self) -> None:
        self._events.close()
