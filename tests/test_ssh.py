"""The SSH runner against a real sshd on loopback: streaming, exit codes, refused host keys, a dropped link."""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from crossalign.agents.server import free_port, stop_process
from crossalign.agents.ssh import HostKeyRejected, SshConnectionError, SshRunner
from crossalign.flows.launch import classify
from crossalign.site import SshHost
from crossalign.tasks.errors import InfrastructureError, StepFailed

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = pytest.mark.skipif(not (os.path.exists(SSHD) and shutil.which("ssh-keygen")),
                                reason="OpenSSH server not installed (scripts/setup.sh --dev installs openssh-server)")


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sshd")
    host_pub = _keygen(folder / "host_key")
    client_pub = _keygen(folder / "client_key")
    (folder / "authorized_keys").write_text(client_pub + "\n")
    os.chmod(folder / "authorized_keys", 0o600)
    port = free_port()
    (folder / "sshd_config").write_text(f"""
Port {port}
ListenAddress 127.0.0.1
HostKey {folder / 'host_key'}
PidFile none
AuthorizedKeysFile {folder / 'authorized_keys'}
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
LogLevel ERROR
""")
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(folder / "sshd_config")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                pytest.fail(f"sshd did not start: {proc.stdout.read() if proc.stdout else ''}")
            time.sleep(0.1)
    key_type, key_data = host_pub.split()[:2]
    (folder / "known_hosts").write_text(f"[127.0.0.1]:{port} {key_type} {key_data}\n")
    other_pub = _keygen(folder / "other_host_key")
    (folder / "known_hosts_wrong").write_text(f"[127.0.0.1]:{port} {' '.join(other_pub.split()[:2])}\n")
    (folder / "known_hosts_empty").write_text("")
    try:
        yield {"folder": folder, "port": port, "proc": proc}
    finally:
        stop_process(proc)


def _host(sshd, known_hosts: str = "known_hosts") -> SshHost:
    return SshHost(hostname="127.0.0.1", port=sshd["port"], username=getpass.getuser(),
                   key_file=sshd["folder"] / "client_key", known_hosts=sshd["folder"] / known_hosts,
                   connect_timeout_s=10)


def test_command_output_streams_line_by_line_into_callback_and_log(sshd, tmp_path, caplog):
    arrivals = []
    log = tmp_path / "remote.log"
    code = SshRunner(_host(sshd)).run(
        "echo first; echo to-stderr >&2; sleep 0.6; printf 'a\\nlast-without-newline'; exit 3",
        on_line=lambda line: arrivals.append((time.monotonic(), line)), log_path=log, cwd="/tmp")
    lines = [line for _, line in arrivals]
    assert code == 3
    assert lines == ["first", "to-stderr", "a", "last-without-newline"]
    assert arrivals[2][0] - arrivals[0][0] > 0.4, "lines must arrive as they are printed, not at the end"
    assert log.read_text().splitlines() == lines
    shipped = [r.getMessage() for r in caplog.records if r.name == "crossalign.ssh"]
    assert shipped == [f"[127.0.0.1] {line}" for line in lines], "lines reach the logger Prefect ships"


def test_compound_command_runs_in_the_working_directory(sshd, tmp_path):
    folder = tmp_path / "with space; and semicolon"
    folder.mkdir()
    lines = []
    code = SshRunner(_host(sshd)).run("pwd; echo 'two words'", on_line=lines.append, cwd=folder)
    assert code == 0 and lines == [str(folder), "two words"]
    assert SshRunner(_host(sshd)).run("echo never", on_line=lines.append, cwd=tmp_path / "missing") != 0
    assert "never" not in lines


def test_script_runner_runs_a_backend_run_script_remotely(sshd, tmp_path):
    script = tmp_path / "run_megatron.sh"
    script.write_text("#!/usr/bin/env bash\nset -euo pipefail\necho iteration 1\necho iteration 2\n")
    lines = []
    runner = SshRunner(_host(sshd)).script_runner(workdir=tmp_path)
    assert runner(script, tmp_path / "train.log", lines.append) == 0
    assert lines == ["iteration 1", "iteration 2"]
    assert (tmp_path / "train.log").read_text() == "iteration 1\niteration 2\n"


def test_a_changed_host_key_is_refused(sshd):
    with pytest.raises(HostKeyRejected, match="does not match"):
        SshRunner(_host(sshd, "known_hosts_wrong")).run("echo never", on_line=print)
    assert isinstance(classify("megatron-train", HostKeyRejected("x")), StepFailed), "never retried"


def test_an_unknown_host_key_is_refused_and_not_added(sshd):
    known = sshd["folder"] / "known_hosts_empty"
    with pytest.raises(HostKeyRejected, match="not in"):
        SshRunner(_host(sshd, "known_hosts_empty")).run("echo never", on_line=print)
    assert known.read_text() == ""


def test_unreachable_host_is_an_infrastructure_failure(sshd):
    closed = SshHost(hostname="127.0.0.1", port=free_port(), username="nobody",
                     key_file=sshd["folder"] / "client_key", known_hosts=sshd["folder"] / "known_hosts",
                     connect_timeout_s=5)
    with pytest.raises(SshConnectionError) as caught:
        SshRunner(closed).run("echo never", on_line=print)
    assert isinstance(classify("megatron-train", caught.value), InfrastructureError)


def test_a_dropped_connection_is_an_infrastructure_failure(sshd):
    """Kill the sshd session process while the command runs: the runner must not report an exit code."""
    before = _children(sshd["proc"].pid)
    seen = []

    def on_line(line: str) -> None:
        seen.append(line)
        if line == "started":
            for pid in _children(sshd["proc"].pid) - before:
                os.kill(pid, signal.SIGKILL)

    started = time.monotonic()
    with pytest.raises(SshConnectionError):
        SshRunner(_host(sshd)).run("echo started; sleep 30; echo never", on_line=on_line)
    assert seen == ["started"] and time.monotonic() - started < 20


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found
