"""Contenders side by side: each in a live subprocess of its own, their timed steps alternating.

A ratio of two step times measured one process after the other carries the machine's drift between the two
(on a shared 2-core VM the same step has taken 250 ms in one minute and 330 in the next). Here every
contender starts, builds and warms up in turn, then the parent asks each for one step at a time (turn_order:
who goes first rotates, the rest are shuffled), so load from other processes falls on all of them alike; each
keeps its own peak memory.

    # in the child, after building and warming up
    timed, warm, losses = serve(step)                  # step() -> loss; until the parent says "done"
    print(json.dumps({...}))                           # its result: the last line of stdout

    # in the parent
    results = run_paced({"ours": (cmd, env), "theirs": (cmd, env)}, turns=8, warm=1, timeout_s=3600)

The protocol: the child prints ``PACE`` + {"ready": true} when built, then reads a line per step from stdin,
"step" (timed) or "warm" (an untimed step, at the start of a turn: a process's first step after another's ran
slower), answering each with PACE + {"step_s": seconds}; any other line ends it.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

PACE = "@@bench "  # the prefix of the protocol's lines on the child's stdout (libraries may print too)


def say(message: dict) -> None:
    print(PACE + json.dumps(message), flush=True)


def serve(step: Callable[[], float]) -> tuple[list[float], list[float], list[float]]:
    """Child side: say ready, then take a step for each "step" or "warm" line on stdin, answering with its time,
    until any other line. Returns (timed step seconds, warm step seconds, every step's loss)."""
    timed, warm, losses = [], [], []
    say({"ready": True})
    for command in iter(sys.stdin.readline, ""):
        if command.strip() not in ("step", "warm"):
            break
        t0 = time.perf_counter()
        losses.append(step())
        seconds = time.perf_counter() - t0
        (timed if command.strip() == "step" else warm).append(seconds)
        say({"step_s": seconds})
    return timed, warm, losses


def turn_order(names: list[str], turn: int) -> list[str]:
    """Who steps when in turn `turn`: each name first in turn in rotation, the rest in a shuffled order (seeded by
    the turn), so that no contender always follows the same one (a process's step after another's runs slower)."""
    first = names[turn % len(names)]
    rest = [n for n in names if n != first]
    random.Random(turn).shuffle(rest)
    return [first, *rest]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_paced(children: dict[str, tuple[list[str], dict | None]], turns: int, warm: int, timeout_s: float,
              label: str = "") -> dict[str, dict]:
    """Parent side: start every child (name -> (command, extra environment)) in turn, each building and warming up
    alone on the machine but for the others' idle memory, then `turns` turns in which each takes `warm` untimed
    steps and one timed step, in turn_order. name -> the JSON of its last stdout line, with
    "wall_s" (from its start to its end) added, or {"error": its last line of stderr} for a child that failed,
    hung (past timeout_s for the whole run) or died."""
    procs: dict[str, subprocess.Popen] = {}
    started: dict[str, float] = {}
    errors: dict[str, dict] = {}
    logs: dict[str, tempfile.TemporaryFile] = {}
    watchdog = threading.Timer(timeout_s, lambda: [p.kill() for p in procs.values()])  # a hung child: its
    watchdog.daemon = True  # pipe closes, read() returns None and it is recorded as failed
    watchdog.start()

    def read(name: str) -> dict | None:  # the next protocol line of `name`; None when it ended
        for line in iter(procs[name].stdout.readline, ""):
            if PACE in line:  # anywhere: a library's output without a newline may come first
                return json.loads(line[line.index(PACE) + len(PACE):])
        return None

    def send(name: str, command: str) -> dict | None:  # None when the child is gone (its answer otherwise)
        try:
            procs[name].stdin.write(command + "\n")
            procs[name].stdin.flush()
        except OSError:  # BrokenPipeError: it died while another ran
            return None
        return read(name)

    def fail(name: str) -> None:
        procs[name].kill()  # ended already, or hung: either way its result is an error
        procs[name].wait()
        logs[name].seek(0)
        err = logs[name].read().decode(errors="replace")
        _log(f"[bench]   {name}{label} failed:\n{err[-3000:]}")
        errors[name] = {"error": (err.strip().splitlines() or ["?"])[-1]}

    try:
        for name, (cmd, env) in children.items():
            logs[name] = tempfile.TemporaryFile()
            started[name] = time.perf_counter()
            procs[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[name],
                                           text=True, env={**os.environ, **(env or {})})
            if read(name) is None:
                fail(name)
        live = [n for n in children if n not in errors]
        for i in range(turns if live else 0):
            for name in turn_order(live, i):
                for command in ("warm",) * warm + ("step",):  # its turn: untimed steps first, then one timed
                    if name not in errors and send(name, command) is None:
                        fail(name)
        results = {}
        for name in children:
            if name in errors:
                results[name] = errors[name]
                continue
            try:
                procs[name].stdin.write("done\n")
                procs[name].stdin.close()
            except OSError:
                pass  # it died: wait() below says so
            last = procs[name].stdout.read().strip().splitlines()
            if procs[name].wait() != 0 or not last:
                fail(name)
                results[name] = errors[name]
                continue
            results[name] = {**json.loads(last[-1]), "wall_s": time.perf_counter() - started[name]}
        return results
    finally:
        watchdog.cancel()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for log in logs.values():
            log.close()
