"""Run a command on a machine that cannot run a Prefect worker, over SSH, streaming its output.

Host keys are checked against known_hosts and an unknown or changed key is refused
(``RejectPolicy``): a training host is never trusted silently. The command runs in a
pseudo-terminal so that closing the connection (a cancelled run) hangs the remote process up
instead of leaving it training unobserved.

Every remote line is also logged on the ``crossalign.ssh`` logger, which the deployments ship to
the Prefect run logs (``PREFECT_LOGGING_EXTRA_LOGGERS=crossalign`` in prefect.yaml).
"""

from __future__ import annotations

import logging
import shlex
import socket
from pathlib import Path
from crossalign.agents.runner import LineCallback
from crossalign.site import SshHost

LOG = logging.getLogger("crossalign.ssh")
LOG.setLevel(logging.INFO)  # Prefect ships extra loggers' records only at the logger's own level


class HostKeyRejected(ValueError):
    """The host's key is unknown or differs from known_hosts: refused, and never worth a retry."""


class SshAuthenticationFailed(ValueError):
    """The host refused our key or user."""


class SshConnectionError(ConnectionError):
    """The host could not be reached or the connection dropped: infrastructure, worth a retry."""


def known_hosts_path(host: SshHost) -> Path:
    return Path(host.known_hosts or "~/.ssh/known_hosts").expanduser()


def remote_command(command: str, *, cwd: Path | str | None = None) -> str:
    """``cd CWD && eval COMMAND``, quoted for the remote shell.

    ``eval`` keeps a compound command (``a; b``) together behind the ``cd``: nothing runs in the
    wrong directory if the ``cd`` fails.
    """
    if cwd is None:
        return command
    return f"cd {shlex.quote(str(cwd))} && eval {shlex.quote(command)}"


class SshRunner:
    """One SSH host from the site config."""

    def __init__(self, host: SshHost):
        self.host = host

    def _connect(self):
        # paramiko: only runs on an SSH host need it
        import paramiko

        known = known_hosts_path(self.host)
        client = paramiko.SSHClient()
        if known.exists():
            client.load_host_keys(str(known))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        key_file = str(Path(self.host.key_file).expanduser()) if self.host.key_file else None
        where = f"{self.host.username + '@' if self.host.username else ''}{self.host.hostname}:{self.host.port}"
        try:
            client.connect(self.host.hostname, port=self.host.port, username=self.host.username,
                           key_filename=key_file, look_for_keys=key_file is None, allow_agent=key_file is None,
                           timeout=self.host.connect_timeout_s, banner_timeout=self.host.connect_timeout_s,
                           auth_timeout=self.host.connect_timeout_s)
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyRejected(f"ssh {where}: the host key ({exc.key.get_name()}) does not match the one in "
                                  f"{known}; refusing to connect (possible man-in-the-middle, or the host "
                                  f"was reinstalled: check and update known_hosts yourself)") from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise SshAuthenticationFailed(f"ssh {where}: authentication failed ({exc})") from None
        except paramiko.SSHException as exc:
            client.close()
            if "known_hosts" in str(exc) or "not found in known" in str(exc):
                raise HostKeyRejected(f"ssh {where}: the host key is not in {known}; refusing to connect "
                                      f"(add it after checking its fingerprint, e.g. with ssh-keyscan)") from None
            raise SshConnectionError(f"ssh {where}: {exc}") from None
        except (OSError, EOFError) as exc:
            client.close()
            raise SshConnectionError(f"ssh {where}: cannot connect: {exc}") from None
        return client

    def run(self, command: str, *, on_line: LineCallback, log_path: Path | None = None,
            cwd: Path | str | None = None) -> int:
        """Run ``command`` remotely; every output line goes to ``on_line`` and ``log_path``. Returns its exit code.

        A connection lost before the command ended raises SshConnectionError.
        """
        client = self._connect()
        log = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(log_path, "w", buffering=1)
        try:
            channel = client.get_transport().open_session()
            channel.get_pty(width=500)
            channel.exec_command(remote_command(command, cwd=cwd))
            buffer = b""
            def emit(raw: bytes) -> None:
                line = raw.decode("utf-8", errors="replace").rstrip("\r")
                if log is not None:
                    log.write(line + "\n")
                LOG.info("[%s] %s", self.host.hostname, line)
                on_line(line)

            while True:
                try:
                    chunk = channel.recv(65536)
                except (socket.timeout, OSError, EOFError) as exc:
                    raise SshConnectionError(f"ssh {self.host.hostname}: connection lost: {exc}") from None
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    emit(raw)
            if buffer:
                emit(buffer)
            status = channel.recv_exit_status()
            if status == -1:
                raise SshConnectionError(f"ssh {self.host.hostname}: connection closed before the command ended")
            return status
        finally:
            if log is not None:
                log.close()
            client.close()

    def script_runner(self, workdir: Path | str | None = None):
        """A runner for the real backends: ``runner(script, log_path, on_line)`` runs ``bash script`` on this host.

        The script and log live on the shared store, which the host mounts at the same path.
        """
        def run_script(script: Path, log_path: Path, on_line: LineCallback) -> int:
            return self.run(shlex.join(["bash", str(script)]), on_line=on_line, log_path=log_path, cwd=workdir)

        return run_script
