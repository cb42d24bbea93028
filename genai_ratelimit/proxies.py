"""Who an anonymous client is: its network (an IPv6 client per /64), and its address behind
reverse proxies you trust.

Networks. One IPv6 subscriber gets a whole /64 (often a /56 or a /48) and picks a fresh
address in it at will: counted per address, it would get a fresh budget with every request.
So anonymous clients are counted per network: IPv4 per address (/32) and IPv6 per /64 by
default; `client_network` does the arithmetic and `ClientNetworks` is an `identify` with
prefixes of your choosing.

    from genai_ratelimit.fastapi import RateLimit
    from genai_ratelimit.proxies import ClientNetworks

    limit = RateLimit(identify=ClientNetworks(v4_prefix=32, v6_prefix=56).identify)

Proxies. Behind nginx or a load balancer every connection comes from the proxy: without
help, all anonymous clients share the proxy's address, hence one budget. The proxy says who
the client was in `X-Forwarded-For`, but any client can send that header too. Only the hops
that YOUR proxies appended can be believed: walking the header from the right, the first
address that is not one of your proxies is the client.

    from genai_ratelimit.proxies import TrustedProxies

    proxies = TrustedProxies(["10.0.0.0/8", "127.0.0.1"])   # your proxies' addresses
    limit = RateLimit(identify=proxies.identify)

    # A proxy that reaches the service on a unix socket (uvicorn --uds): the server reports
    # no client address; trust that peer, and only that, with unix_socket=True.
    proxies = TrustedProxies(unix_socket=True)

A connection from an address that is not a trusted proxy is the client itself, whatever
headers it sends. Run the ASGI server so that it reports the TCP peer (uvicorn
`--no-proxy-headers`), or let the server do the same job with the same list (uvicorn
`--forwarded-allow-ips` with your proxies' addresses, never "*") and keep the default
identify: one of the two, not both.

Never one shared bucket by accident: an anonymous request whose address cannot be known (the
server reports none: a unix socket not trusted, or a trusted proxy that sent no usable hop)
is refused with HTTP 500 and `x-should-retry: false`, and a warning on the `genai_ratelimit`
logger names the fix, rather than counted in one `ip:unknown` bucket that every such client
would share (UnknownClientAddress).
"""

from .fastapi._clients import (
    DEFAULT_V4_PREFIX,
    DEFAULT_V6_PREFIX,
    Anonymous,
    ClientNetworks,
    TrustedProxies,
    UnknownClientAddress,
    client_network,
    state_value,
)

__all__ = ["ClientNetworks", "TrustedProxies", "UnknownClientAddress", "client_network",
           "DEFAULT_V4_PREFIX", "DEFAULT_V6_PREFIX", "Anonymous", "state_value"]
