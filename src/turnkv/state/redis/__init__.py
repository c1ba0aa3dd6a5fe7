"""The Redis conversation store, shared by every gateway replica: one server, Sentinel or Cluster.

``store.RedisStore`` puts the three parts of the contract (``state.base``) on one connection
(``connection``, over the clients of ``clients``): ``records``, ``pins`` (the pin index) and
``documents``, each in a module of its own. How they share Redis:

Keys (``ns`` the namespace; ``{...}`` is the Redis Cluster hash tag: each group lives in one slot):

* ``ns:c:{key}``: a conversation, a hash. A stored record: ``r`` (the record's JSON, handle left
  out), and while it pins ``h`` (the handle's JSON), ``p`` (its pin id) and ``i`` (its engine's
  index id); ``u`` says why it no longer does once evicted. A claimed one holds only ``m``, the
  claiming turn (the in-flight marker), with the in-flight TTL. A marker is never handed out, not
  even to its owner: a claim retried after a dropped reply sees ``in_flight`` (a recompute, never
  a handle used twice).
* ``ns:pins:{<hash of the decode URL>}:z|e|t|n``: one decode engine's pin index: a sorted set of
  conversation keys scored by ``stored_at`` (idle since), a hash of their entries (tokens, handle,
  expiry, epoch, pin id, tenant, and a nonce that tells this put from an identical later one), the
  running token total, and a hash of the tokens each tenant pins (an evict's fair shares).
* ``ns:d:{key}``: a document (a string with a TTL).

Every script touches one slot. Operations that span a conversation and an index are separate
single-slot steps, in an order where a race costs at most a stale or missing index entry, never a
handle released under a turn that holds it nor a handle used after its release:

* claim: take the record (marker in), then drop its index entry if that entry still names the
  claimed pin id. In between, an evict may pick the entry; its compare-and-set sees the marker and
  leaves the record alone, and the entry is not returned: the claiming turn owns the handle. The
  entry is dropped only when it names that pin id, so a newer pin stored meanwhile stays indexed.
  If the second step fails the entry is an orphan, which prune drops.
* put: the record (replacing whatever is there, a marker included), then its index entry, in one
  pipeline (one server runs them in that order; in a Cluster two nodes may run them in either
  order). A claim between the two leaves an orphan entry (the evict CAS refuses it, prune drops
  it). Should the entry land first, an evict in between finds no record holding that pin and
  drops the entry unreturned: the handle stays pinned, unindexed, until its next turn claims it or
  D's TTL frees it. A put that replaces a record holding another pin drops that pin's entry in one
  more round trip (rare: concurrent turns of one conversation).
* evict: pick entries off the index (removed atomically there), then per record a CAS that strips
  the handle only if the record still holds that pin id (a marker holds none); only those are
  returned for release. A claim before the CAS keeps the handle (it owns it); one after gets the
  record without it. If the CAS step fails, the picked records keep their handles, unindexed: a
  lost budget entry, never a release of a handle in use.
* prune: read the index, ask the records whether they still hold each pin, then drop entries by
  their exact stored value (the nonce), so an entry stored again meanwhile is kept.

Round trips: claim 1 (2 when the record holds a handle), put 1, release 1, pinned 1 for any number
of engines, evict 2 per 256 entries, prune 1-3, docs 1; plus one per script on the first use after
Redis lost its script cache (NOSCRIPT: the script itself, EVAL, runs and caches it on that node).

The in-flight TTL bounds what a crashed gateway leaves behind: its markers go after
``in_flight_ttl_s``. A marker that times out while its turn still runs costs nothing but a reason
code: a concurrent turn then finds nothing instead of ``in_flight`` and recomputes either way, and
the last put wins; claims stay single-use, so no handle is used twice.

Connections: at most ``max_connections`` operations run at once per store (an asyncio semaphore in
front of redis-py's pools, the same for the three topologies, whose pools are sized to match). A
call that waits longer than ``pool_timeout_s`` for its turn raises ``StoreBusy``: load, not an
outage, which the guard does not count as Redis being down. ``warm`` opens the pool's connections
before traffic comes (a burst of first turns then opens none), and at most ``connect_concurrency``
connections are being opened at once (one server and Sentinel): after Redis restarts, a burst of
calls each reconnecting would otherwise all wait on each other's handshakes; a call that cannot
start opening one in time (as many rounds of the connect timeout as there are rounds of openings ahead
of it: bounded, and only reached when connections fail to open) is ``StoreBusy`` too. Opening a
connection has its own deadline (``connect_timeout_s``), not the command's.

Retries: a command is retried once, at once, on a connection error (a pooled connection Redis
dropped while it was away); a claim, read or release whose new connection did not open in time
(nothing was sent) once more. A timeout is retried once only where running the operation twice is
harmless (``pinned``, ``release``, documents, ``ping``); never ``claim`` (a second
try would find the first one's marker) nor ``put`` (a second write could land after another turn
claimed the first, storing a handle that turn holds). A Cluster client also retries a timeout
once, on a fresh view of the slots. Every redis-py error is translated here, once, into
``StoreError`` with its kind: ``timeout``, ``connect_timeout``, ``unreachable``, ``error``.
"""

from turnkv.state.redis.clients import TLSOptions
from turnkv.state.redis.store import RedisStore

__all__ = ["RedisStore", "TLSOptions"]
