"""A record sink that writes TensorBoard event files (tensorboardX, the optional
``tensorboard`` extra): :class:`TensorBoardSink`."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"  # the run folder's event files


def run_folder_name(series: str) -> str:
    """The folder of a series' TensorBoard run: the series itself (TensorBoard names a run
    by its folder, so the run selector shows the names of ``metrics.jsonl`` and the plots),
    with every character a file name cannot hold safely (a path separator, ``:``...) as
    ``-``; e.g. ``"fedavg client_lr=0.1 seed=0"`` is its own folder name."""
    name = re.sub(r"[^\w .=,+-]", "-", series).strip()
    # A name of dots alone would be the folder itself or its parent.
    return name if name.strip(".") else f"series-{name}"


class TensorBoardSink:
    """A record sink that writes every numeric field of each record as a TensorBoard
    scalar (tag: the field name; step: the record's ``round``), flushed per record, into
    ``<folder>/tensorboard``.

    With ``per_series=True`` each record's ``series`` is its own TensorBoard run, the
    folder ``<folder>/tensorboard/<series>`` (:func:`run_folder_name`), so TensorBoard
    overlays the configs of a sweep on one chart per metric (its convention: one run
    folder per config under the log dir).

    It uses tensorboardX (the optional ``tensorboard`` extra; no TensorFlow needed).
    Pass it as (or call it from) the ``callback=`` of ``Simulation.run`` / ``loop.run``.
    :meth:`close` closes the open event files; a later record opens a new one (a sweep
    closes them after each grid: a run folder per config would otherwise hold one open
    file per config of the whole sweep).

    Raises:
      ImportError: tensorboardX is not installed (the message says how to get it).
    """

    def __init__(self, folder: str | os.PathLike, per_series: bool = False):
        try:
            import tensorboardX  # noqa: F401
        except ImportError as err:
            raise ImportError(
                "--tensorboard needs tensorboardX: pip install 'scaffold-jax[tensorboard]'"
            ) from err
        self.directory = Path(folder) / TENSORBOARD_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.per_series = per_series
        self._writers: dict[Path, Any] = {}

    def _writer(self, series: str | None) -> Any:
        """The open events writer of ``series``' run folder (opened on first use)."""
        from tensorboardX.event_file_writer import EventsWriter

        if self.per_series and series is None:
            raise ValueError(
                "TensorBoardSink(per_series=True) needs a 'series' in every record (and "
                "purge_from(step, series=...)): it names the record's run folder."
            )
        directory = self.directory / run_folder_name(series) if self.per_series else self.directory
        if directory not in self._writers:
            directory.mkdir(parents=True, exist_ok=True)
            # tensorboardX's synchronous events writer: its SummaryWriter queues events for
            # a background thread, whose flush() does not wait for them, so a killed run
            # would lose the last ones. The nanoseconds make the file name unique
            # (tensorboardX names it by the second: a second sink in the same second would
            # overwrite the first) and keep files in the order they were written, which is
            # the order TensorBoard reads them in.
            self._writers[directory] = EventsWriter(
                str(directory / "events"), filename_suffix=f".{time.time_ns()}"
            )
        return self._writers[directory]

    def _write(self, series: str | None, event: Any) -> None:
        writer = self._writer(series)
        writer.write_event(event)
        writer.flush()

    def __call__(self, record: Mapping[str, Any]) -> None:
        from tensorboardX.proto import event_pb2, summary_pb2

        values = [
            summary_pb2.Summary.Value(tag=name, simple_value=float(value))
            for name, value in record.items()
            if name != "round" and isinstance(value, (int, float)) and not isinstance(value, bool)
        ]
        summary = summary_pb2.Summary(value=values)
        event = event_pb2.Event(wall_time=time.time(), step=int(record["round"]), summary=summary)
        self._write(record.get("series"), event)

    def purge_from(self, step: int, series: str | None = None) -> None:
        """Tells TensorBoard to drop the events of step >= ``step`` written before this
        call to the run (``series``' run with ``per_series``; a ``SessionLog.START`` event,
        what ``SummaryWriter(purge_step=)`` writes): a run resumed from its checkpoint at
        round R re-runs rounds R+1, ... whose records the interrupted process may already
        have written."""
        from tensorboardX.proto import event_pb2

        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._write(series, event_pb2.Event(wall_time=time.time(), step=int(step),
                                            session_log=start))  # fmt: skip

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
