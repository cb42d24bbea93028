"""Redis URL parsing: URL in, keyword options for the C limiter out. Runs once per limiter."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["RedisOptions", "parse_redis_url", "DEFAULT_URL"]

DEFAULT_URL = "redis://localhost:6379/0"

_SSL_CERT_REQS = {"required": "required", "none": "none"}
_SSL_PARAMS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
# Where the windows are kept (RateLimiter's storage=): a query parameter of every URL form.
STORAGES = ("zset", "compact")


@dataclass(frozen=True)
class RedisOptions:
    """Where and how to connect. `password` is kept out of repr()."""

    host: str | None = None
    port: int = 6379
    unix_path: str | None = None
    db: int = 0
    username: str | None = field(default=None, repr=False)  # userinfo: never shown either
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    ssl_cert_reqs: str = "required"
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # redis+cluster:// and redis+sentinel://: "single" for the other schemes.
    mode: str = "single"
    nodes: tuple[tuple[str, int], ...] = ()  # cluster seed nodes, or the sentinels
    master_name: str | None = None  # redis+sentinel://: the master the sentinels watch
    storage: str | None = None  # ?storage=zset|compact; None when the URL does not say
    # ?min_replicas=N&replica_timeout_ms=T (every URL form); None when the URL does not say
    min_replicas: int | None = None
    replica_timeout_ms: int | None = None

    def tls_trust(self) -> str | None:
        """The one TLS trust policy of both limiters (the blocking one applies it with
        OpenSSL in C, the asyncio one with the ssl module): None when verification is off
        (ssl_cert_reqs=none), the ssl_ca_certs path when given (that file alone is trusted,
        not the system's store), else "system" (the system's default CAs)."""
        if self.ssl_cert_reqs == "none":
            return None
        return self.ssl_ca_certs or "system"

    def describe(self) -> str:
        """Where this points, without credentials: safe for logs and messages."""
        if self.mode != "single":
            scheme = ("rediss+" if self.tls else "redis+") + self.mode
            hosts = ",".join(_show_host(host, port) for host, port in self.nodes)
            tail = f"/{self.master_name}/{self.db}" if self.mode == "sentinel" else "/"
            return f"{scheme}://{hosts}{tail}"
        if self.unix_path is not None:
            return f"unix://{self.unix_path}?db={self.db}"
        scheme = "rediss" if self.tls else "redis"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}/{self.db}"


def _show_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_hosts(netloc: str, default_port: int, scheme: str) -> list[tuple[str, int]]:
    """"h1:p1,h2:p2,[::1]:p3" (userinfo already removed) into (host, port) pairs."""
    nodes = []
    for item in netloc.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"invalid Redis URL: an empty host in the {scheme}:// host list")
        if item.startswith("["):
            host, sep, rest = item[1:].partition("]")
            if not sep or (rest and not rest.startswith(":")):
                raise ValueError(f"invalid Redis URL: malformed IPv6 host {item!r}")
            port_text = rest[1:]
        else:
            host, _, port_text = item.partition(":")
        if not host:
            raise ValueError(f"invalid Redis URL: a host is missing in {item!r}")
        port = default_port
        if port_text:
            if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
                raise ValueError("invalid Redis URL: the port must be an integer from 1 to 65535")
            port = int(port_text)
        nodes.append((unquote(host), port))
    return nodes


# Said by every refusal that a password (or user name) written as is may have caused. The
# message names no part of the URL: a piece of the URL there may be a piece of the password.
PERCENT_ENCODE = ("a user name or password holding '/', '?', '#', '@', '&' or '%' must be "
                  "percent-encoded (%2F, %3F, %23, %40, %26, %25), e.g. "
                  "urllib.parse.quote(password, safe='')")

# The query parameters whose values may hold an '@' as is (a password, a path).
_AT_IN_VALUE = frozenset({"password", "username", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"})


def _refuse_userinfo_outside_the_authority(url: str) -> None:
    """Refuses a URL with an '@' after its authority (the text between "://" and the first
    '/', '?' or '#'): in the path, the fragment, or the query but in the value of a
    parameter that may hold one. Such an '@' ends a user name or password that holds an
    unencoded '/', '?' or '#': the parser would read the password's pieces as a host, a
    port, a database, a socket path, a master name or query parameters, and a message
    naming any of them would show them. Nothing of the URL goes into the message."""
    _, sep, rest = url.partition("://")
    if not sep:
        return
    ends = [i for i in (rest.find(c) for c in "/?#") if i >= 0]
    tail = rest[min(ends):] if ends else ""
    before_fragment, _, fragment = tail.partition("#")
    path, _, query = before_fragment.partition("?")
    misplaced = "@" in path or "@" in fragment or any(
        "@" in piece and piece.partition("=")[0] not in _AT_IN_VALUE
        for piece in query.split("&"))
    if misplaced:
        raise ValueError("invalid Redis URL: an '@' after the host part (in the path, a query "
                         f"parameter or the fragment); {PERCENT_ENCODE}; so must an '@' in a "
                         "socket path or a master name")


def _parse_db(text: str, url_kind: str) -> int:
    if not text.isdigit():
        raise ValueError(f"invalid Redis URL: the database in a {url_kind} URL must be a "
                         f"non-negative integer, got {text!r}")
    return int(text)


def parse_redis_url(url: str) -> RedisOptions:
    """Parses redis://, rediss:// and unix:// URLs. Raises ValueError naming the problem;
    the message never contains the password."""
    if not isinstance(url, str):
        raise TypeError(f"the Redis URL must be a str, not {type(url).__name__}")
    if not url.strip():
        raise ValueError("invalid Redis URL: it is empty")
    _refuse_userinfo_outside_the_authority(url.strip())
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        # urlsplit's own messages quote the netloc, userinfo included.
        raise ValueError(f"invalid Redis URL: a malformed host part (e.g. an unbalanced '[' "
                         f"or ']'); {PERCENT_ENCODE}") from None
    scheme = parts.scheme.lower()
    try:
        query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise ValueError("invalid Redis URL: malformed query string") from None
    single = {}
    for name, values in query.items():
        if len(values) != 1:
            raise ValueError(f"invalid Redis URL: query parameter {name!r} is given more than once")
        single[name] = values[0]

    if scheme == "unix":
        path = unquote(parts.path)
        if not path:
            raise ValueError("invalid Redis URL: a unix:// URL needs a socket path, "
                             "e.g. unix:///run/redis/redis.sock")
        _refuse_unknown_parameters(single, {"db", "password", "username", "storage", *_REPLICATION},
                                   " for unix://")
        username = unquote(parts.username) if parts.username else single.get("username") or None
        password = unquote(parts.password) if parts.password is not None else single.get("password")
        db = _parse_db(single.get("db", "0"), "unix://")
        return RedisOptions(unix_path=path, db=db, username=username, password=password,
                            storage=_storage(single), **_replication(single))

    if scheme in ("redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel"):
        return _parse_multi_host(url.strip(), parts.path, scheme, single)
    if scheme not in ("redis", "rediss"):
        shown = scheme or "(none)"
        raise ValueError(f"invalid Redis URL: unsupported scheme {shown!r}; use redis://, "
                         "rediss://, unix://, redis+cluster://, rediss+cluster:// or "
                         "redis+sentinel://")
    try:
        host = parts.hostname
        port = parts.port
    except ValueError:
        raise ValueError("invalid Redis URL: the port must be an integer from 1 to 65535") from None
    if not host:
        raise ValueError(f"invalid Redis URL: a {scheme}:// URL needs a host")
    if port == 0:
        raise ValueError("invalid Redis URL: the port must be an integer from 1 to 65535")
    path = parts.path.strip("/")
    db = _parse_db(path, f"{scheme}://") if path else 0
    if "db" in single:
        db = _parse_db(single["db"], f"{scheme}://")
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    if password == "":
        password = None

    tls = scheme == "rediss"
    return RedisOptions(host=host, port=port or 6379, db=db, username=username,
                        password=password, **_tls_options(single, tls))


def _refuse_unknown_parameters(single: dict[str, str], known: set[str], where: str) -> None:
    """Names the unknown query parameters, unless the query carries a password or a user
    name: then an unknown "parameter" may be the piece of one after an unencoded '&'."""
    unknown = set(single) - known
    if not unknown:
        return
    if {"password", "username"} & set(single):
        raise ValueError(f"invalid Redis URL: {len(unknown)} unknown query parameter(s){where} "
                         f"(not named: the query carries credentials); {PERCENT_ENCODE}")
    raise ValueError(f"invalid Redis URL: unknown query parameter(s) {sorted(unknown)}{where}")


def _storage(single: dict[str, str]) -> str | None:
    """The storage= query parameter (every URL form): "zset", "compact", or None."""
    if "storage" not in single:
        return None
    if single["storage"] not in STORAGES:
        raise ValueError(f"invalid Redis URL: unknown storage {single['storage']!r}; "
                         "use 'zset' or 'compact'")
    return single["storage"]


_REPLICATION = ("min_replicas", "replica_timeout_ms")


def _replication(single: dict[str, str]) -> dict[str, Any]:
    """?min_replicas=N&replica_timeout_ms=T (every URL form): the fields given."""
    fields: dict[str, Any] = {}
    for name in _REPLICATION:
        if name in single:
            text = single[name]
            if not text.isdigit() or not (name == "min_replicas" or int(text) >= 1):
                raise ValueError(f"invalid Redis URL: {name} must be a "
                                 f"{'non-negative' if name == 'min_replicas' else 'positive'} "
                                 f"integer, got {text!r}")
            fields[name] = int(text)
    return fields


def _tls_options(single: dict[str, str], tls: bool) -> dict[str, Any]:
    """The TLS fields of RedisOptions from the query parameters (shared by every scheme),
    the storage and the replication parameters."""
    _refuse_unknown_parameters(single, {"db", "storage", *_SSL_PARAMS, *_REPLICATION}, "")
    if not tls and any(name in single for name in _SSL_PARAMS):
        raise ValueError("invalid Redis URL: ssl_* parameters need a rediss:// URL")
    cert_reqs = single.get("ssl_cert_reqs", "required").lower()
    if cert_reqs not in _SSL_CERT_REQS:
        raise ValueError(f"invalid Redis URL: unknown ssl_cert_reqs {single['ssl_cert_reqs']!r}; "
                         "use 'required' or 'none'")
    return {
        "tls": tls,
        "ssl_cert_reqs": _SSL_CERT_REQS[cert_reqs],
        "ssl_ca_certs": single.get("ssl_ca_certs") or None,
        "ssl_certfile": single.get("ssl_certfile") or None,
        "ssl_keyfile": single.get("ssl_keyfile") or None,
        "storage": _storage(single),
        **_replication(single),
    }


def _parse_multi_host(url: str, path: str, scheme: str, single: dict[str, str]) -> RedisOptions:
    """redis+cluster://[[user]:password@]h1:p1,h2:p2[/] and
    redis+sentinel://[[user]:password@]s1:p1,s2:p2/<master-name>[/db] (rediss+ for TLS).
    urlsplit cannot take a host list (its port parser fails on "p1,h2"): the netloc is
    split here. The credentials are the data nodes' (the sentinels get the same)."""
    netloc = url.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user_text, colon, password_text = userinfo.partition(":")
        username = unquote(user_text) or None
        password = unquote(password_text) if colon and password_text else None
    if not hosts:
        raise ValueError(f"invalid Redis URL: a {scheme}:// URL needs at least one host")
    sentinel = scheme.endswith("+sentinel")
    nodes = _parse_hosts(hosts, 26379 if sentinel else 6379, scheme)
    fields = [unquote(part) for part in path.split("/") if part]
    master_name = None
    db = 0
    if sentinel:
        if not fields:
            raise ValueError("invalid Redis URL: a redis+sentinel:// URL needs the master's "
                             "name, e.g. redis+sentinel://127.0.0.1:26379/mymaster")
        master_name = fields.pop(0)
        if fields:
            db = _parse_db(fields.pop(0), f"{scheme}://")
    elif len(fields) == 1 and fields[0].isdigit():
        db = int(fields.pop())
    if "db" in single:
        db = _parse_db(single["db"], f"{scheme}://")
    if fields:
        raise ValueError(f"invalid Redis URL: unexpected path {path!r} in a {scheme}:// URL")
    if not sentinel and db != 0:
        raise ValueError("invalid Redis URL: Redis Cluster has database 0 only")
    return RedisOptions(host=nodes[0][0], port=nodes[0][1], db=db, username=username,
                        password=password, mode="sentinel" if sentinel else "cluster",
                        nodes=tuple(nodes), master_name=master_name,
                        **_tls_options(single, scheme.startswith("rediss")))


def ssl_context(options: RedisOptions) -> ssl.SSLContext:
    """The client TLS context of a rediss:// URL, following the one trust policy both
    limiters keep (RedisOptions.tls_trust): certificates and the host name verified unless
    ssl_cert_reqs=none; trusted: the ssl_ca_certs file alone when given, else the system's
    default CAs. A missing or bad file is a ValueError naming it, at construction."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    trust = options.tls_trust()
    if trust is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif trust == "system":
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    else:
        try:
            context.load_verify_locations(cafile=trust)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load CA certificates from {trust}: "
                             f"{exc.strerror or exc}") from None
    if options.ssl_certfile or options.ssl_keyfile:
        certfile = options.ssl_certfile or options.ssl_keyfile
        try:
            context.load_cert_chain(certfile, options.ssl_keyfile)  # type: ignore[arg-type]
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the client certificate {certfile} "
                             f"(key {options.ssl_keyfile or certfile}): {exc.strerror or exc}") from None
    return context
