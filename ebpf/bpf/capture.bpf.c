// SPDX-License-Identifier: MIT OR GPL-2.0-only (the kernel lets GPL-compatible programs use every helper)
//
// ztunnel's eBPF traffic capture for enrolled pods.
//
// Outbound: cgroup/connect4 (attached at the cgroup v2 root, so every process) rewrites a
// TCP connect() made inside an enrolled pod's netns to 127.0.0.1:15001 and remembers the
// original destination under the socket cookie. sockops (TCP_CONNECT_CB, when the source
// port is known) re-keys it by the client's (netns, ip, port), which is what the proxy's
// accepted socket sees as its peer; cgroup/getsockopt answers SO_ORIGINAL_DST from it,
// so the proxy reads the destination exactly as with iptables REDIRECT. getpeername4
// shows the client app the address it asked for. sock_release drops the entries.
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
// proxy's 127.0.0.1:15053 instead of 15001; UDP to port 53 too, through connect4 for
// connected sockets and sendmsg4 for the others, with the original server recorded under
// the socket cookie. recvmsg4 then shows the answers as coming from that server (resolvers
// such as glibc's drop answers from anyone else), and getpeername4 shows it for connected
// sockets. The proxy forwards from its own netns, so its upstream queries are never seen
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
#define SO_ORIGINAL_DST 80
#define LOOPBACK_IFINDEX 1

#define PROXY_MARK 1337
#define DELIVERY_MARK 0x111
#define OUTBOUND_PORT 15001
#define HBONE_PORT 15008
#define DNS_PORT 53
#define DNS_PROXY_PORT 15053
#define LOOPBACK_ADDR 0x7f000001
// 169.254.7.127: kubelet probes in Istio's ambient mode.
#define PROBE_SOURCE 0xa9fe077f

struct pod_config {
	__u32 ip;	/* network order */
	__u32 flags;	/* POD_* */
};

// The pod's DNS goes to the DNS proxy.
#define POD_DNS 1

// An original destination; ip and port in network order.
struct orig_dst {
	__u32 ip;
	__u16 port;
	__u16 pad;
};

struct cookie_entry {
	struct orig_dst dst;
	__u64 netns;
	/* the client's address as zt_orig_by_tuple keys it (set by sockops), so release can
	   delete that entry too; port 0: none yet */
	__u32 client_ip;
	__u32 client_port;
};

// zt_orig_by_tuple's value: the destination, and which socket it is for (a later socket
// can reuse the client port while the first is still open).
struct tuple_value {
	struct orig_dst dst;
	__u64 cookie;
};

struct tuple_key {
	__u64 netns;
	__u32 ip;	/* client address, network order */
	__u32 port;	/* client port, host order */
};

// A TCP connection inside one netns, by its addresses; ports in host order. The netns
// is part of the key: a mark set in another pod's netns must not exempt anything here.
struct conn_key {
	__u64 netns;
	__u32 src_ip;
	__u32 dst_ip;
	__u16 src_port;
	__u16 dst_port;
	__u32 pad;
};

// Enrolled pods for outbound capture: netns cookie -> pod.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct pod_config);
} zt_pods_netns SEC(".maps");

// Enrolled pods for inbound capture: pod IP (network order) -> the pod's netns cookie
// (sk_lookup has no helper for it; removal checks it so a newer pod with a reused IP
// keeps its capture).
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u64);
} zt_pods_ip SEC(".maps");

// Each pod's inbound plaintext (15006) listener, by pod IP.
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
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

// Where a connect() (TCP or UDP) or sendmsg() (UDP) to IPv4 address `dst`, port
// `port` (network order) from this socket goes: NOT_CAPTURED, TO_OUTBOUND (TCP, 15001)
// or TO_DNS (port 53, 15053); CAPTURE_FAILED if the original destination could not be
// recorded under the socket cookie.
#define CAPTURE_FAILED -1
#define NOT_CAPTURED 0
#define TO_OUTBOUND 1
#define TO_DNS 2

static __always_inline int capture_dst(struct bpf_sock_addr *ctx, __u32 dst, __u16 port)
{
	int tcp = ctx->type == SOCK_STREAM && (ctx->protocol == 0 || ctx->protocol == IPPROTO_TCP);
	int udp = ctx->type == SOCK_DGRAM && (ctx->protocol == 0 || ctx->protocol == IPPROTO_UDP);
	int dns_port = port == bpf_htons(DNS_PORT);
	// Cheap test first: sendmsg4 runs for every unconnected UDP datagram on the host.
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
	if (sk->mark == DELIVERY_MARK && tcp && dst == pod->ip)
		return reserve_delivery(cookie, netns) ? NOT_CAPTURED : CAPTURE_FAILED;
	if (is_proxy_mark(sk->mark))
		return NOT_CAPTURED;
	// Loopback, the pod's own address and 0.0.0.0 stay inside the pod (nftables: oif lo).
	if ((bpf_ntohl(dst) >> 24) == 127 || dst == pod->ip || dst == 0)
		return NOT_CAPTURED;
	int dns = dns_port && (pod->flags & POD_DNS);
	if (udp && !dns)
		return NOT_CAPTURED;
	struct cookie_entry e = {
		.dst = { .ip = dst, .port = port },
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

// Steers a captured connect() or sendmsg() to `dst` (the IPv4 destination; in a
// v4-mapped address when `v6`) to the proxy's listener on loopback. The program's verdict.
static __always_inline int steer(struct bpf_sock_addr *ctx, __u32 dst, int v6)
{
	int c = capture_dst(ctx, dst, (__u16)ctx->user_port);
	if (c == CAPTURE_FAILED)
		return 0; // EPERM to the app: better than a connection the proxy cannot route
	if (c == NOT_CAPTURED)
		return 1;
	if (v6)
		ctx->user_ip6[3] = bpf_htonl(LOOPBACK_ADDR);
	else
		ctx->user_ip4 = bpf_htonl(LOOPBACK_ADDR);
	ctx->user_port = capture_port(c);
	return 1;
}

SEC("cgroup/connect4")
int zt_connect4(struct bpf_sock_addr *ctx)
{
	return steer(ctx, ctx->user_ip4, 0);
}

// Unconnected UDP: each datagram to port 53 goes to the DNS proxy.
SEC("cgroup/sendmsg4")
int zt_sendmsg4(struct bpf_sock_addr *ctx)
{
	if (ctx->type != SOCK_DGRAM)
		return 1;
	return steer(ctx, ctx->user_ip4, 0);
}

// Puts the original destination capture recorded for this socket, if any, in ctx's
// IPv4 address. Returns 1 (the only verdict getpeername and recvmsg programs may give).
static __always_inline int show_original4(struct bpf_sock_addr *ctx)
{
	__u64 cookie = bpf_get_socket_cookie(ctx);
	struct cookie_entry *e = bpf_map_lookup_elem(&zt_orig_by_cookie, &cookie);
	if (e) {
		ctx->user_ip4 = e->dst.ip;
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

static __always_inline int is_v4_mapped(__u32 a0, __u32 a1, __u32 a2)
{
	return a0 == 0 && a1 == 0 && a2 == bpf_htonl(0xffff);
}

// Dual-stack sockets (AF_INET6, e.g. Java's default) reach IPv4 destinations through
// v4-mapped addresses: capture those the same way, or they would bypass the mesh.
// Native IPv6 from an enrolled pod is refused (EPERM) except ::1: the proxy is IPv4
// only, and nftables capture fails closed for IPv6 too.
SEC("cgroup/connect6")
int zt_connect6(struct bpf_sock_addr *ctx)
{
	__u32 a0 = ctx->user_ip6[0], a1 = ctx->user_ip6[1], a2 = ctx->user_ip6[2], a3 = ctx->user_ip6[3];
	asm volatile("" ::: "memory");
	if (!is_v4_mapped(a0, a1, a2)) {
		if (ctx->type != SOCK_STREAM)
			return 1;
		__u64 netns = bpf_get_netns_cookie(ctx);
		if (!bpf_map_lookup_elem(&zt_pods_netns, &netns))
			return 1;
		struct bpf_sock *sk = ctx->sk;
		if (!sk || is_proxy_mark(sk->mark))
			return 1;
		int loopback = a0 == 0 && a1 == 0 && a2 == 0 && a3 == bpf_htonl(1);
		return loopback ? 1 : 0;
	}
	// v4-mapped UDP (DNS included) is left alone: without recvmsg6 its answers would
	// come from the proxy's address, which resolvers refuse.
	if (ctx->type != SOCK_STREAM)
		return 1;
	return steer(ctx, a3, 1);
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
	__u32 local6 = skops->local_ip6[3];
	__u32 r0 = skops->remote_ip6[0], r1 = skops->remote_ip6[1], r2 = skops->remote_ip6[2], r3 = skops->remote_ip6[3];
	__u32 local_port = skops->local_port, remote_port = skops->remote_port;
	__u32 cb_flags = skops->bpf_sock_ops_cb_flags;
	asm volatile("" ::: "memory");
	__u32 local_ip, remote_ip;
	if (family == AF_INET) {
		local_ip = local4;
		remote_ip = remote4;
	} else if (family == AF_INET6 && is_v4_mapped(r0, r1, r2)) {
		local_ip = local6;
		remote_ip = r3;
	} else {
		return 1;
	}
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

SEC("cgroup/getsockopt")
int zt_getsockopt(struct bpf_sockopt *ctx)
{
	if (ctx->level != SOL_IP || ctx->optname != SO_ORIGINAL_DST)
		return 1;
	struct bpf_sock *sk = ctx->sk;
	if (!sk || sk->family != AF_INET)
		return 1;
	struct tuple_key k = {
		.netns = bpf_get_netns_cookie(ctx),
		.ip = sk->dst_ip4,
		.port = bpf_ntohs(sk->dst_port),
	};
	struct tuple_value *found = bpf_map_lookup_elem(&zt_orig_by_tuple, &k);
	if (!found)
		return 1;
	struct orig_dst copy = found->dst;
	struct orig_dst *v = &copy;
	struct sockaddr_in_bpf {
		__u16 family;
		__u16 port;
		__u32 addr;
		__u8 zero[8];
	} *sa = ctx->optval;
	if ((void *)(sa + 1) > ctx->optval_end)
		return 1;
	sa->family = AF_INET;
	sa->port = v->port;
	sa->addr = v->ip;
	__builtin_memset(sa->zero, 0, sizeof(sa->zero));
	// Two 4-byte context stores: the verifier refuses the 8-byte one clang would merge them into.
	ctx->optlen = sizeof(*sa);
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
	__u64 cookie = bpf_get_socket_cookie(ctx);
	struct cookie_entry *e = bpf_map_lookup_elem(&zt_orig_by_cookie, &cookie);
	if (!e)
		return 1;
	ctx->user_ip6[3] = e->dst.ip;
	ctx->user_port = e->dst.port;
	return 1;
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
	// This program only runs in enrolled pods' netns; the proxy is IPv4 only, so IPv6
	// from the network fails closed (as with nftables) instead of reaching the app.
	if (ctx->family != AF_INET)
		return SK_DROP;
	__u32 ip = ctx->local_ip4;
	__u64 *netns = bpf_map_lookup_elem(&zt_pods_ip, &ip);
	if (!netns)
		return SK_PASS;
	__u16 port = ctx->local_port;
	__u32 remote = ctx->remote_ip4;
	if (port == HBONE_PORT || remote == bpf_htonl(PROBE_SOURCE))
		return SK_PASS;
	// The app calling itself, with no map entry to exhaust: from its own address, or
	// from 127/8 (a martian on any wire, so only ever local).
	if (remote == ip || (bpf_ntohl(remote) >> 24) == 127)
		return SK_PASS;
	if (bpf_map_lookup_elem(&zt_exempt_ports, &port))
		return SK_PASS;
	struct conn_key c = {
		.netns = *netns,
		.src_ip = remote,
		.dst_ip = ip,
		.src_port = bpf_ntohs(ctx->remote_port),
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
