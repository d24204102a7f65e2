"""Imported only by the fork server CPU ranks fork from (``distrain.launch.fork_server``), as its first preloaded
module:
the server ignores the stop signals a scheduler may send to every process of a job, which its ranks handle."""

import signal

from distrain.launch.fork_server import STOP_SIGNALS

for stop_signal in STOP_SIGNALS:
    signal.signal(stop_signal, signal.SIG_IGN)
