// SPDX-License-Identifier: MIT OR GPL-2.0-only (the kernel lets GPL-compatible programs use every helper)
//
// ztunnel's eBPF traffic capture for enrolled pods.
//
// Outbound: cgroup/connect4 and connect6 (attached at the cgroup v2 root, so every
// process) rewrite a TCP connect() made inside an enrolled pod's netns to 127.0.0.1:15001
// (IPv6: [::1]:15001; a dual-stack socket dialing a v4-mapped address: ::ffff:127.0.0.1)
// and remember the original destination under the socket cookie. sockops (TCP_CONNECT_CB, when the source
// port is known) re-keys it by the client's (netns, ip, port), which is what the proxy's
// accepted socket sees as its peer; cgroup/getsockopt answers SO_ORIGINAL_DST from it,
// so the proxy reads the destination exactly as with iptables REDIRECT (IPv6:
// IP6T_SO_ORIGINAL_DST). getpeername4/6 show the client app the address it asked for.
// sock_release drops the entries.
//
// Addresses: every map holds 16-byte addresses, IPv4 ones v4-mapped (::ffff:a.b.c.d), so
// one layout serves both families and a v4-mapped connect from a dual-stack socket meets
// the same entries as a plain IPv4 one. A pod enrolled without an IPv6 address (IPv6 off
// for it) has its native IPv6 TCP refused (EPERM) and dropped inbound: fail closed.
//
// Inbound: sk_lookup, attached to each enrolled pod's netns, steers TCP arriving from the
// network at the pod's IP to the pod's 15006 listener (from a SOCKHASH keyed by pod IP),
// except HBONE (15008), the app calling itself (source = destination, or a 127/8 source,
// which the kernel never accepts from the wire), the proxy's deliveries (recorded by
// connect4 and sockops, see below), the kubelet probe source and exempt ports. The accepted
// socket keeps the original local address, so the destination is getsockname(), as with
// TPROXY.
//
// Bounds: every per-connection entry is charged to the netns that made it
// (zt_netns_usage), and a netns over its share is refused (EPERM on connect) instead of
// crowding out other pods: a pod flooding connects hurts only itself. Entries go at the
// TCP close state change and at socket release, whichever comes first, and a re-connect()
// on one socket replaces its entry instead of orphaning it.
//
// DNS (pods whose pod_config has POD_DNS): a TCP connect() to port 53 goes to the DNS
// proxy's 127.0.0.1:15053 ([::1]:15053) instead of 15001; UDP to port 53 too, through
// connect4/6 for connected sockets and sendmsg4/6 for the others, with the original server
// recorded under the socket cookie. recvmsg4/6 then show the answers as coming from that
// server (resolvers such as glibc's drop answers from anyone else), and getpeername4/6
// show it for connected sockets. The proxy forwards from its own netns, so its upstream queries are never seen
// here (and carry the proxy mark anyway).
//
// Every program is a no-op outside the netns cookies / pod IPs in its maps. An app that
// can set SO_MARK (CAP_NET_RAW/NET_ADMIN) to the proxy's marks can exempt its own
// connections, as with Istio's iptables rules; the mark cannot exempt anything in
// another pod's netns.

#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/socket.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#ifndef AF_INET
#define AF_INET 2
#endif
#ifndef AF_INET6
#define AF_INET6 10
#endif
#define SOCK_STREAM 1
#define SOCK_DGRAM 2
#define SOL_IP 0
#define SOL_IPV6 41
// SO_ORIGINAL_DST (SOL_IP) and IP6T_SO_ORIGINAL_DST (SOL_IPV6) share the number.
#define SO_ORIGINAL_DST 80
#define LOOPBACK_IFINDEX 1

#define PROXY_MARK 1337
#define DELIVERY_MARK 0x111
#define OUTBOUND_PORT 15001
#define HBONE_PORT 15008
#define DNS_PORT 53
#define DNS_PROXY_PORT 15053
#define LOOPBACK_ADDR 0x7f000001
// 169.254.7.127: kubelet probes in Istio's ambient mode; IPv6: istio-cni's
// fd16:9254:7127:1337:ffff:ffff:ffff:ffff.
#define PROBE_SOURCE 0xa9fe077f
#define PROBE_SOURCE6_0 0xfd169254
#define PROBE_SOURCE6_1 0x71271337

// An address in network order: IPv6, or IPv4 v4-mapped (::ffff:a.b.c.d).
struct addr6 {
	__u32 w[4];
};

struct pod_config {
	__u32 ip4;	/* network order; 0: none */
	__u32 flags;	/* POD_* */
	struct addr6 ip6;	/* all zero: no IPv6 capture (native IPv6 is refused) */
};

// The pod's DNS goes to the DNS proxy.
#define POD_DNS 1

// An original destination; port in network order.
struct orig_dst {
	struct addr6 ip;
	__u16 port;
	__u16 pad;
};

struct cookie_entry {
	struct orig_dst dst;
	/* the client's address as zt_orig_by_tuple keys it (set by sockops), so release can
	   delete that entry too; port 0: none yet */
	__u32 client_port;
	__u64 netns;
	struct addr6 client_ip;
};

// zt_orig_by_tuple's value: the destination, and which socket it is for (a later socket
// can reuse the client port while the first is still open).
struct tuple_value {
	struct orig_dst dst;
	__u32 pad;
	__u64 cookie;
};

struct tuple_key {
	__u64 netns;
	struct addr6 ip;	/* client address */
	__u32 port;	/* client port, host order */
	__u32 pad;
};

// A TCP connection inside one netns, by its addresses; ports in host order. The netns
// is part of the key: a mark set in another pod's netns must not exempt anything here.
struct conn_key {
	__u64 netns;
	struct addr6 src_ip;
	struct addr6 dst_ip;
	__u16 src_port;
	__u16 dst_port;
	__u32 pad;
};

static __always_inline struct addr6 mapped(__u32 ip4)
{
	struct addr6 a = { { 0, 0, bpf_htonl(0xffff), ip4 } };
	return a;
}

static __always_inline int is_mapped(const struct addr6 *a)
{
	return a->w[0] == 0 && a->w[1] == 0 && a->w[2] == bpf_htonl(0xffff);
}

static __always_inline int addr_eq(const struct addr6 *a, const struct addr6 *b)
{
	return a->w[0] == b->w[0] && a->w[1] == b->w[1] && a->w[2] == b->w[2] && a->w[3] == b->w[3];
}

static __always_inline int is_zero(const struct addr6 *a)
{
	return (a->w[0] | a->w[1] | a->w[2] | a->w[3]) == 0;
}

// 127/8, ::ffff:127/104 or ::1: never on the wire, only ever local.
static __always_inline int is_loopback(const struct addr6 *a)
{
	if (is_mapped(a))
		return (bpf_ntohl(a->w[3]) >> 24) == 127;
	return a->w[0] == 0 && a->w[1] == 0 && a->w[2] == 0 && a->w[3] == bpf_htonl(1);
}

// 0.0.0.0 or ::
static __always_inline int is_unspecified(const struct addr6 *a)
{
	return is_zero(a) || (is_mapped(a) && a->w[3] == 0);
}

// The pod's own address (of either family).
static __always_inline int is_pod_ip(const struct pod_config *pod, const struct addr6 *a)
{
	if (is_mapped(a))
		return pod->ip4 != 0 && a->w[3] == pod->ip4;
	return !is_zero(&pod->ip6) && addr_eq(&pod->ip6, a);
}

// Enrolled pods for outbound capture: netns cookie -> pod.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct pod_config);
} zt_pods_netns SEC(".maps");

// Enrolled pods for inbound capture: pod IP -> the pod's netns cookie (sk_lookup has no
// helper for it; removal checks it so a newer pod with a reused IP keeps its capture).
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, struct addr6);
	__type(value, __u64);
} zt_pods_ip SEC(".maps");

// Each pod's inbound plaintext (15006) listener of the address's family, by pod IP.
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 8192);
	__type(key, struct addr6);
	__type(value, __u32);	/* a socket fd on update (what aya's SockHash writes) */
} zt_inbound SEC(".maps");

// Inbound destination ports never captured (host order) -> 1.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 256);
	__type(key, __u16);
	__type(value, __u8);
} zt_exempt_ports SEC(".maps");

// Per-connection entries one netns may hold: far above what one pod's proxy traffic
// needs, a small share of each map (so it takes 16 pods at their limit to fill one).
#define ORIG_PER_NETNS 16384
#define LOCAL_PER_NETNS 16384

// What each enrolled netns holds in the per-connection maps. Signed: a racing decrement
// may dip below zero, which must never read as "over the limit". Entries are created on
// first use by an enrolled pod's socket and removed with the pod by ztunnel.
struct netns_usage {
	__s32 local;	/* zt_local_by_cookie entries */
	__s32 orig;	/* zt_orig_by_cookie entries */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, __u64);
	__type(value, struct netns_usage);
} zt_netns_usage SEC(".maps");

// Captured sockets' original destinations. Not LRU: every socket's release is seen
// (the programs stay attached through restarts), so entries cannot be orphaned, and
// eviction would let one pod's flood push out another's; the per-netns limit bounds it
// instead. Allocated on use.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, struct cookie_entry);
} zt_orig_by_cookie SEC(".maps");

// Read (and deleted) by the proxy's getsockopt right after accept, deleted at the
// client socket's release otherwise; LRU only as a last resort.

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct tuple_key);
	__type(value, struct tuple_value);
} zt_orig_by_tuple SEC(".maps");

// The proxy's transparent deliveries to an enrolled pod's app (DELIVERY_MARK, made in the
// pod's netns to its own address, from the original client's address). sk_lookup must
// not steer them to 15006 (nftables: `iifname lo return`); their route's input interface
// is the pod's eth0, not lo, so only their addresses tell them apart. Plain hashes, not
// LRU: an evicted by-cookie entry would leave its exemption behind for a later connection.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct conn_key);
	__type(value, __u8);
} zt_local_conns SEC(".maps");

// The same deliveries by socket cookie: the netns's reservation, taken at connect()
// (ports zero until sockops knows them), and how the close and release callbacks (which
// cannot read the source address) find the zt_local_conns entry: a stale one would let a
// later connection with the same addresses from the network past 15006.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, struct conn_key);
} zt_local_by_cookie SEC(".maps");

// Charges one entry of `field` (0: local, 1: orig) to netns; 0 when its share is spent.
static __always_inline int take_share(__u64 netns, int orig)
{
	struct netns_usage *u = bpf_map_lookup_elem(&zt_netns_usage, &netns);
	if (!u) {
		struct netns_usage zero = {};
		bpf_map_update_elem(&zt_netns_usage, &netns, &zero, BPF_NOEXIST);
		u = bpf_map_lookup_elem(&zt_netns_usage, &netns);
		if (!u)
			return 0;
	}
	__s32 *n = orig ? &u->orig : &u->local;
	if (*n >= (orig ? ORIG_PER_NETNS : LOCAL_PER_NETNS))
		return 0;
	__sync_fetch_and_add(n, 1);
	return 1;
}

static __always_inline void give_share(__u64 netns, int orig)
{
	struct netns_usage *u = bpf_map_lookup_elem(&zt_netns_usage, &netns);
	if (!u)
		return; // the pod is gone, and its usage with it
	__sync_fetch_and_add(orig ? &u->orig : &u->local, -1);
}

// Removes a delivery's entries (on close or release, whichever comes first).
static __always_inline void forget_local(__u64 cookie)
{
	struct conn_key *c = bpf_map_lookup_elem(&zt_local_by_cookie, &cookie);
	if (!c)
		return;
	struct conn_key copy = *c;
	bpf_map_delete_elem(&zt_local_conns, &copy);
	// Only the caller whose delete succeeds gives the share back.
	if (bpf_map_delete_elem(&zt_local_by_cookie, &cookie) == 0)
		give_share(copy.netns, 0);
}

static __always_inline int is_proxy_mark(__u32 mark)
{
	return mark == PROXY_MARK || mark == DELIVERY_MARK;
}

// A delivery's connect() in an enrolled pod's netns: reserves its zt_local_by_cookie
// entry, charged to the netns (sockops fills in the addresses). A re-connect() on the
// same socket drops the exemption of its earlier addresses and keeps the reservation.
// 0 when the netns's share is spent: the connect fails (EPERM) rather than loop through
// 15006. Marks in netns that are not enrolled never get here.
static __always_inline int reserve_delivery(__u64 cookie, __u64 netns)
{
	struct conn_key *old = bpf_map_lookup_elem(&zt_local_by_cookie, &cookie);
	if (old) {
		struct conn_key copy = *old;
		bpf_map_delete_elem(&zt_local_conns, &copy);
		struct conn_key empty = { .netns = copy.netns };
		bpf_map_update_elem(&zt_local_by_cookie, &cookie, &empty, BPF_EXIST);
		return 1;
	}
	if (!take_share(netns, 0))
		return 0;
	struct conn_key reserved = { .netns = netns };
	if (bpf_map_update_elem(&zt_local_by_cookie, &cookie, &reserved, BPF_NOEXIST) != 0) {
		give_share(netns, 0);
		return 0;
	}
	return 1;
}

// Where a connect() (TCP or UDP) or sendmsg() (UDP) to address `dst`, port `port`
// (network order) from this socket goes: NOT_CAPTURED, TO_OUTBOUND (TCP, 15001) or TO_DNS
// (port 53, 15053); CAPTURE_FAILED (EPERM to the app) if the original destination could not
// be recorded under the socket cookie, or if it is native IPv6 TCP from a pod without
// IPv6 capture.
#define CAPTURE_FAILED -1
#define NOT_CAPTURED 0
#define TO_OUTBOUND 1
#define TO_DNS 2

static __always_inline int capture_dst(struct bpf_sock_addr *ctx, const struct addr6 *dst, __u16 port)
{
	int tcp = ctx->type == SOCK_STREAM && (ctx->protocol == 0 || ctx->protocol == IPPROTO_TCP);
	int udp = ctx->type == SOCK_DGRAM && (ctx->protocol == 0 || ctx->protocol == IPPROTO_UDP);
	int dns_port = port == bpf_htons(DNS_PORT);
	// Cheap test first: sendmsg runs for every unconnected UDP datagram on the host.
	if ((!tcp && !udp) || (udp && !dns_port))
		return NOT_CAPTURED;
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct pod_config *pod = bpf_map_lookup_elem(&zt_pods_netns, &netns);
	if (!pod)
		return NOT_CAPTURED;
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return NOT_CAPTURED;
	__u64 cookie = bpf_get_socket_cookie(ctx);
	if (sk->mark == DELIVERY_MARK && tcp && is_pod_ip(pod, dst))
		return reserve_delivery(cookie, netns) ? NOT_CAPTURED : CAPTURE_FAILED;
	if (is_proxy_mark(sk->mark))
		return NOT_CAPTURED;
	// Loopback, the pod's own address and 0.0.0.0 / :: stay inside the pod (nftables: oif lo).
	if (is_loopback(dst) || is_pod_ip(pod, dst) || is_unspecified(dst))
		return NOT_CAPTURED;
	// Native IPv6 of a pod the proxy has no IPv6 listeners for: nowhere to send it.
	if (!is_mapped(dst) && is_zero(&pod->ip6))
		return tcp ? CAPTURE_FAILED : NOT_CAPTURED;
	int dns = dns_port && (pod->flags & POD_DNS);
	if (udp && !dns)
		return NOT_CAPTURED;
	struct cookie_entry e = {
		.dst = { .ip = *dst, .port = port },
		.netns = netns,
	};
	// A socket captured before (a re-connect, or the next datagram) keeps its share.
	if (!bpf_map_lookup_elem(&zt_orig_by_cookie, &cookie)) {
		if (!take_share(netns, 1))
			return CAPTURE_FAILED;
		if (bpf_map_update_elem(&zt_orig_by_cookie, &cookie, &e, BPF_NOEXIST) != 0) {
			give_share(netns, 1);
			return CAPTURE_FAILED;
		}
	} else if (bpf_map_update_elem(&zt_orig_by_cookie, &cookie, &e, BPF_EXIST) != 0) {
		return CAPTURE_FAILED;
	}
	return dns ? TO_DNS : TO_OUTBOUND;
}

static __always_inline __u16 capture_port(int c)
{
	return bpf_htons(c == TO_DNS ? DNS_PROXY_PORT : OUTBOUND_PORT);
}

// Steers a captured connect() or sendmsg() to `dst` to the proxy's listener on loopback:
// 127.0.0.1 for an IPv4 socket (`v6sock` 0), ::ffff:127.0.0.1 for a v4-mapped destination
// of an IPv6 socket, ::1 for a native IPv6 one. The program's verdict.
static __always_inline int steer(struct bpf_sock_addr *ctx, const struct addr6 *dst, int v6sock)
{
	int c = capture_dst(ctx, dst, (__u16)ctx->user_port);
	if (c == CAPTURE_FAILED)
		return 0; // EPERM to the app: better than a connection the proxy cannot route
	if (c == NOT_CAPTURED)
		return 1;
	if (!v6sock) {
		ctx->user_ip4 = bpf_htonl(LOOPBACK_ADDR);
	} else if (is_mapped(dst)) {
		ctx->user_ip6[3] = bpf_htonl(LOOPBACK_ADDR);
	} else {
		ctx->user_ip6[0] = 0;
		ctx->user_ip6[1] = 0;
		ctx->user_ip6[2] = 0;
		ctx->user_ip6[3] = bpf_htonl(1);
	}
	ctx->user_port = capture_port(c);
	return 1;
}

static __always_inline int steer4(struct bpf_sock_addr *ctx)
{
	struct addr6 dst = mapped(ctx->user_ip4);
	return steer(ctx, &dst, 0);
}

// The destination of an IPv6 socket's connect() or sendmsg(); every field loaded once, up
// front (see sockops).
static __always_inline struct addr6 user_addr6(struct bpf_sock_addr *ctx)
{
	struct addr6 a = { { ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3] } };
	asm volatile("" ::: "memory");
	return a;
}

SEC("cgroup/connect4")
int zt_connect4(struct bpf_sock_addr *ctx)
{
	return steer4(ctx);
}

// Unconnected UDP: each datagram to port 53 goes to the DNS proxy.
SEC("cgroup/sendmsg4")
int zt_sendmsg4(struct bpf_sock_addr *ctx)
{
	if (ctx->type != SOCK_DGRAM)
		return 1;
	return steer4(ctx);
}

// IPv6 sockets: native IPv6, and the v4-mapped addresses dual-stack sockets (e.g. Java's
// default) reach IPv4 destinations with, captured the same way.
SEC("cgroup/connect6")
int zt_connect6(struct bpf_sock_addr *ctx)
{
	struct addr6 dst = user_addr6(ctx);
	return steer(ctx, &dst, 1);
}

SEC("cgroup/sendmsg6")
int zt_sendmsg6(struct bpf_sock_addr *ctx)
{
	if (ctx->type != SOCK_DGRAM)
		return 1;
	struct addr6 dst = user_addr6(ctx);
	return steer(ctx, &dst, 1);
}

// The original destination capture recorded for this socket, if any.
static __always_inline struct cookie_entry *recorded(void *ctx)
{
	__u64 cookie = bpf_get_socket_cookie(ctx);
	return bpf_map_lookup_elem(&zt_orig_by_cookie, &cookie);
}

// Puts the recorded original destination, if any, in ctx's IPv4 address. Returns 1 (the
// only verdict getpeername and recvmsg programs may give).
static __always_inline int show_original4(struct bpf_sock_addr *ctx)
{
	struct cookie_entry *e = recorded(ctx);
	if (e) {
		ctx->user_ip4 = e->dst.ip.w[3];
		ctx->user_port = e->dst.port;
	}
	return 1;
}

// The same for an IPv6 socket (a v4-mapped destination shows v4-mapped).
static __always_inline int show_original6(struct bpf_sock_addr *ctx)
{
	struct cookie_entry *e = recorded(ctx);
	if (e) {
		struct addr6 a = e->dst.ip;
		ctx->user_ip6[0] = a.w[0];
		ctx->user_ip6[1] = a.w[1];
		ctx->user_ip6[2] = a.w[2];
		ctx->user_ip6[3] = a.w[3];
		ctx->user_port = e->dst.port;
	}
	return 1;
}

// A datagram from the DNS proxy to a socket that sent DNS through it appears to come from
// the server the socket last sent to.
SEC("cgroup/recvmsg4")
int zt_recvmsg4(struct bpf_sock_addr *ctx)
{
	if (ctx->user_ip4 != bpf_htonl(LOOPBACK_ADDR) || ctx->user_port != bpf_htons(DNS_PROXY_PORT))
		return 1;
	return show_original4(ctx);
}

SEC("cgroup/recvmsg6")
int zt_recvmsg6(struct bpf_sock_addr *ctx)
{
	if (ctx->user_port != bpf_htons(DNS_PROXY_PORT))
		return 1;
	struct addr6 from = user_addr6(ctx);
	struct addr6 lo4 = mapped(bpf_htonl(LOOPBACK_ADDR));
	if (!addr_eq(&from, &lo4) && (is_mapped(&from) || !is_loopback(&from)))
		return 1;
	return show_original6(ctx);
}

// A connection's (local, remote) addresses from context fields the caller loaded (the
// loads must stay in the program, on its own context type); 0 for another family.
static __always_inline int conn_addrs(__u32 family, __u32 local4, __u32 remote4, struct addr6 local6, struct addr6 remote6,
				      struct addr6 *local, struct addr6 *remote)
{
	if (family == AF_INET) {
		*local = mapped(local4);
		*remote = mapped(remote4);
		return 1;
	}
	if (family == AF_INET6) {
		*local = local6;
		*remote = remote6;
		return 1;
	}
	return 0;
}

SEC("sockops")
int zt_sockops(struct bpf_sock_ops *skops)
{
	__u32 op = skops->op;
	if (op == BPF_SOCK_OPS_STATE_CB) {
		// A delivery's exemption ends with its connection, even while the proxy still
		// holds the socket.
		if (skops->args[1] == BPF_TCP_CLOSE)
			forget_local(bpf_get_socket_cookie(skops));
		return 1;
	}
	if (op != BPF_SOCK_OPS_TCP_CONNECT_CB)
		return 1;
	// Every context field is loaded once, up front: the verifier refuses the
	// pointer-offset loads clang makes when a load is shared between branches.
	__u32 family = skops->family;
	__u32 local4 = skops->local_ip4, remote4 = skops->remote_ip4;
	struct addr6 l6 = { { skops->local_ip6[0], skops->local_ip6[1], skops->local_ip6[2], skops->local_ip6[3] } };
	struct addr6 r6 = { { skops->remote_ip6[0], skops->remote_ip6[1], skops->remote_ip6[2], skops->remote_ip6[3] } };
	__u32 local_port = skops->local_port, remote_port = skops->remote_port;
	__u32 cb_flags = skops->bpf_sock_ops_cb_flags;
	asm volatile("" ::: "memory");
	struct addr6 local_ip, remote_ip;
	if (!conn_addrs(family, local4, remote4, l6, r6, &local_ip, &remote_ip))
		return 1;
	__u64 cookie = bpf_get_socket_cookie(skops);
	// A delivery reserved at connect(): the source port is bound by now and the SYN not
	// yet sent, so the entry is in place before sk_lookup sees the connection.
	struct conn_key *reserved = bpf_map_lookup_elem(&zt_local_by_cookie, &cookie);
	if (reserved) {
		struct conn_key c = {
			.netns = reserved->netns,
			.src_ip = local_ip,
			.dst_ip = remote_ip,
			.src_port = (__u16)local_port,
			.dst_port = (__u16)bpf_ntohl(remote_port),
		};
		__u8 one = 1;
		if (bpf_map_update_elem(&zt_local_by_cookie, &cookie, &c, BPF_EXIST) == 0)
			bpf_map_update_elem(&zt_local_conns, &c, &one, BPF_ANY);
		bpf_sock_ops_cb_flags_set(skops, cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
		return 1;
	}
	struct cookie_entry *e = bpf_map_lookup_elem(&zt_orig_by_cookie, &cookie);
	if (!e)
		return 1;
	struct tuple_key k = { .netns = e->netns, .ip = local_ip, .port = local_port };
	struct tuple_value v = { .dst = e->dst, .cookie = cookie };
	e->client_ip = local_ip;
	e->client_port = local_port;
	bpf_map_update_elem(&zt_orig_by_tuple, &k, &v, BPF_ANY);
	return 1;
}

// SO_ORIGINAL_DST (IPv4) and IP6T_SO_ORIGINAL_DST (IPv6) on the proxy's accepted socket,
// answered from what sockops recorded under the client's address.
SEC("cgroup/getsockopt")
int zt_getsockopt(struct bpf_sockopt *ctx)
{
	int level = ctx->level;
	if (ctx->optname != SO_ORIGINAL_DST || (level != SOL_IP && level != SOL_IPV6))
		return 1;
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	__u32 family = sk->family;
	__u32 d4 = sk->dst_ip4;
	__u32 d0 = sk->dst_ip6[0], d1 = sk->dst_ip6[1], d2 = sk->dst_ip6[2], d3 = sk->dst_ip6[3];
	__u32 dport = sk->dst_port;
	asm volatile("" ::: "memory");
	int v4 = level == SOL_IP && family == AF_INET;
	if (!v4 && !(level == SOL_IPV6 && family == AF_INET6))
		return 1;
	struct tuple_key k = {
		.netns = bpf_get_netns_cookie(ctx),
		.port = bpf_ntohs((__u16)dport),
	};
	if (v4) {
		k.ip = mapped(d4);
	} else {
		struct addr6 a = { { d0, d1, d2, d3 } };
		k.ip = a;
	}
	struct tuple_value *found = bpf_map_lookup_elem(&zt_orig_by_tuple, &k);
	if (!found)
		return 1;
	struct orig_dst v = found->dst;
	if (v4) {
		struct sockaddr_in_bpf {
			__u16 family;
			__u16 port;
			__u32 addr;
			__u8 zero[8];
		} *sa = ctx->optval;
		if ((void *)(sa + 1) > ctx->optval_end)
			return 1;
		sa->family = AF_INET;
		sa->port = v.port;
		sa->addr = v.ip.w[3];
		__builtin_memset(sa->zero, 0, sizeof(sa->zero));
		// Two 4-byte context stores: the verifier refuses the 8-byte one clang would merge them into.
		ctx->optlen = sizeof(*sa);
	} else {
		struct sockaddr_in6_bpf {
			__u16 family;
			__u16 port;
			__u32 flowinfo;
			__u32 addr[4];
			__u32 scope_id;
		} *sa6 = ctx->optval;
		if ((void *)(sa6 + 1) > ctx->optval_end)
			return 1;
		sa6->family = AF_INET6;
		sa6->port = v.port;
		sa6->flowinfo = 0;
		sa6->addr[0] = v.ip.w[0];
		sa6->addr[1] = v.ip.w[1];
		sa6->addr[2] = v.ip.w[2];
		sa6->addr[3] = v.ip.w[3];
		sa6->scope_id = 0;
		ctx->optlen = sizeof(*sa6);
	}
	asm volatile("" ::: "memory");
	ctx->retval = 0;
	// Read once: the proxy asks right after accept. Entries never asked for go when
	// the client socket is released.
	bpf_map_delete_elem(&zt_orig_by_tuple, &k);
	return 1;
}

SEC("cgroup/getpeername4")
int zt_getpeername4(struct bpf_sock_addr *ctx)
{
	return show_original4(ctx);
}

SEC("cgroup/getpeername6")
int zt_getpeername6(struct bpf_sock_addr *ctx)
{
	return show_original6(ctx);
}

SEC("cgroup/sock_release")
int zt_sock_release(struct bpf_sock *sk)
{
	if (sk->protocol != IPPROTO_TCP && sk->protocol != IPPROTO_UDP)
		return 1;
	// Entries keyed by this socket's cookie go whether or not its pod is still enrolled
	// (it may have been removed while the socket lived). UDP sockets only have the DNS
	// server they sent to.
	__u64 cookie = bpf_get_socket_cookie(sk);
	struct cookie_entry *e = bpf_map_lookup_elem(&zt_orig_by_cookie, &cookie);
	if (e) {
		struct cookie_entry copy = *e;
		if (copy.client_port != 0) {
			// Never read by the proxy (it did not accept in time): nothing else removes it.
			struct tuple_key k = { .netns = copy.netns, .ip = copy.client_ip, .port = copy.client_port };
			struct tuple_value *t = bpf_map_lookup_elem(&zt_orig_by_tuple, &k);
			if (t && t->cookie == cookie)
				bpf_map_delete_elem(&zt_orig_by_tuple, &k);
		}
		if (bpf_map_delete_elem(&zt_orig_by_cookie, &cookie) == 0)
			give_share(copy.netns, 1);
	}
	forget_local(cookie);
	return 1;
}

SEC("sk_lookup")
int zt_sk_lookup(struct bpf_sk_lookup *ctx)
{
	if (ctx->protocol != IPPROTO_TCP || ctx->ingress_ifindex == LOOPBACK_IFINDEX)
		return SK_PASS;
	__u32 family = ctx->family;
	__u32 local4 = ctx->local_ip4, remote4 = ctx->remote_ip4;
	struct addr6 l6 = { { ctx->local_ip6[0], ctx->local_ip6[1], ctx->local_ip6[2], ctx->local_ip6[3] } };
	struct addr6 r6 = { { ctx->remote_ip6[0], ctx->remote_ip6[1], ctx->remote_ip6[2], ctx->remote_ip6[3] } };
	__u32 local_port = ctx->local_port, remote_port = ctx->remote_port;
	asm volatile("" ::: "memory");
	struct addr6 ip, remote;
	if (!conn_addrs(family, local4, remote4, l6, r6, &ip, &remote))
		return SK_PASS;
	__u64 *netns = bpf_map_lookup_elem(&zt_pods_ip, &ip);
	// This program only runs in enrolled pods' netns. IPv6 to anything but an enrolled
	// pod address (a link-local one, or any IPv6 of a pod without IPv6 capture) fails
	// closed, as with nftables, instead of reaching the app around the proxy.
	if (!netns)
		return family == AF_INET6 ? SK_DROP : SK_PASS;
	__u16 port = (__u16)local_port;
	struct addr6 probe4 = mapped(bpf_htonl(PROBE_SOURCE));
	struct addr6 probe6 = { { bpf_htonl(PROBE_SOURCE6_0), bpf_htonl(PROBE_SOURCE6_1), 0xffffffff, 0xffffffff } };
	if (port == HBONE_PORT || addr_eq(&remote, &probe4) || addr_eq(&remote, &probe6))
		return SK_PASS;
	// The app calling itself, with no map entry to exhaust: from its own address, or
	// from loopback (a martian on any wire, so only ever local).
	if (addr_eq(&remote, &ip) || is_loopback(&remote))
		return SK_PASS;
	if (bpf_map_lookup_elem(&zt_exempt_ports, &port))
		return SK_PASS;
	struct conn_key c = {
		.netns = *netns,
		.src_ip = remote,
		.dst_ip = ip,
		.src_port = bpf_ntohs((__u16)remote_port),
		.dst_port = port,
	};
	if (bpf_map_lookup_elem(&zt_local_conns, &c))
		return SK_PASS;
	struct bpf_sock *sk = bpf_map_lookup_elem(&zt_inbound, &ip);
	// Enrolled but no listener (the proxy is restarting): drop the SYN so the client
	// retries, rather than let plaintext reach the app around policy.
	if (!sk)
		return SK_DROP;
	long err = bpf_sk_assign(ctx, sk, 0);
	bpf_sk_release(sk);
	return err == 0 ? SK_PASS : SK_DROP;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
