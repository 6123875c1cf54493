"""How the ``snapshotd`` command reads a flag's value: from the environment (``SNAPSHOTD_<FLAG>``, the default of
every flag), as an endpoint (one address form for every endpoint flag), and the job's secret.

``--max-rate`` is ``SNAPSHOTD_MAX_RATE``; a switch takes ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/
``off``. A value a flag does not take is a ``ValueError`` naming the variable.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["ENV_PREFIX", "endpoint", "env_name", "from_environment", "read_secret"]

ENV_PREFIX = "SNAPSHOTD_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def env_name(flag: str) -> str:
    """The environment variable of a long flag: ``--max-rate`` -> ``SNAPSHOTD_MAX_RATE``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def from_environment(parser: argparse.ArgumentParser) -> None:
    """Give each of ``parser``'s long flags (``-v``, ``--help`` and ``--version`` aside) its default from
    ``SNAPSHOTD_<FLAG>`` where that is set, and name the variable in its help.

    Raises:
        ValueError: a variable's value is not one its flag takes (a switch's, or one of its choices).
    """
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest in ("help", "version", "verbose_here"):
            continue
        name = env_name(longs[0])
        action.help = f"{action.help or ''} [${name}]".strip()
        value = os.environ.get(name)
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            if value.strip().lower() not in _TRUE + _FALSE:
                raise ValueError(f"${name}={value!r}: a switch, one of {', '.join(_TRUE + _FALSE[:-1])}")
            action.default = value.strip().lower() in _TRUE
        else:
            if action.choices is not None and value not in action.choices:
                raise ValueError(f"${name}={value!r}: not one of {', '.join(map(str, action.choices))}")
            action.default = value  # argparse converts a string default with the flag's type
            action.required = False


def endpoint(text: str) -> str:
    """An endpoint flag's value as ZeroMQ takes it: ``tcp://HOST:PORT``, ``ipc://PATH`` and ``mem://NAME`` as
    given; ``HOST:PORT`` as ``tcp://HOST:PORT``; a bare port as ``tcp://127.0.0.1:PORT``.

    Raises:
        argparse.ArgumentTypeError: none of these.
    """
    text = text.strip()
    if "://" in text:
        return text
    if text.isdigit():
        return f"tcp://127.0.0.1:{text}"
    host, sep, port = text.rpartition(":")
    if sep and host and port.isdigit():
        return f"tcp://{text}"
    raise argparse.ArgumentTypeError(
        f"{text!r} is not an endpoint: write tcp://HOST:PORT, HOST:PORT or a port"
    )


def read_secret(path: str | None) -> str | None:
    """The job's secret: the contents of ``path`` (its surrounding whitespace stripped) where given, else
    ``$SNAPSHOTD_SECRET``; None when neither has one.

    Raises:
        ValueError: ``path`` cannot be read, or holds nothing.
    """
    if path is None:
        return os.environ.get("SNAPSHOTD_SECRET") or None
    try:
        with open(path) as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read --secret-file {path}: {exc.strerror or exc}") from None
    if not secret:
        raise ValueError(f"--secret-file {path} is empty")
    return secret
