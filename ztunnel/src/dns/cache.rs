//! A bounded cache of upstream answers, shared by every pod of the node (the forwarded
//! question does not depend on who asked). Bounded by entries and by bytes (the stored
//! wire form plus the key); the least recently used entry goes first. An entry lives
//! for the answer's TTL (the smallest of its records', capped at [`MAX_TTL`]; negative
//! answers for their SOA's negative TTL, RFC 2308) and is served with its TTLs counted
//! down. Truncated answers, server failures and answers without a TTL are not cached.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::{DNSClass, RData, RecordType};

/// The longest an answer is kept, whatever its TTL says.
pub const MAX_TTL: u32 = 300;
/// Bookkeeping charged per entry on top of its bytes.
const ENTRY_OVERHEAD: usize = 96;

/// What a cached answer answers: the question and the flags that change the answer.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct CacheKey {
    /// Lower-case, with the trailing dot.
    pub name: String,
    pub qtype: RecordType,
    pub qclass: DNSClass,
    pub dnssec_ok: bool,
    pub checking_disabled: bool,
}

struct Entry {
    wire: Vec<u8>,
    stored: Instant,
    expires: Instant,
    /// Position in the recency order.
    seq: u64,
    size: usize,
}

#[derive(Default)]
struct Inner {
    map: HashMap<CacheKey, Entry>,
    /// seq -> key, oldest use first.
    order: BTreeMap<u64, CacheKey>,
    next: u64,
    bytes: usize,
}

pub struct Cache {
    inner: Mutex<Inner>,
    max_entries: usize,
    max_bytes: usize,
}

/// A cache hit: the answer as received, and how long it has been stored.
pub struct Hit {
    pub wire: Vec<u8>,
    pub age: Duration,
}

impl Cache {
    /// `max_entries` 0 disables caching.
    pub fn new(max_entries: usize, max_bytes: usize) -> Cache {
        Cache {
            inner: Mutex::new(Inner::default()),
            max_entries,
            max_bytes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, key: &CacheKey, now: Instant) -> Option<Hit> {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let entry = inner.map.get_mut(key)?;
        if now >= entry.expires {
            let seq = entry.seq;
            inner.order.remove(&seq);
            if let Some(e) = inner.map.remove(key) {
                inner.bytes -= e.size;
            }
            return None;
        }
        inner.order.remove(&entry.seq);
        entry.seq = inner.next;
        inner.next += 1;
        inner.order.insert(entry.seq, key.clone());
        Some(Hit {
            wire: entry.wire.clone(),
            age: now.saturating_duration_since(entry.stored),
        })
    }

    /// Stores `wire` (the upstream answer) for `ttl` seconds.
    pub fn insert(&self, key: CacheKey, wire: Vec<u8>, ttl: u32, now: Instant) {
        let size = wire.len() + key.name.len() + ENTRY_OVERHEAD;
        if self.max_entries == 0 || ttl == 0 || size > self.max_bytes {
            return;
        }
        let mut inner = self.lock();
        let inner = &mut *inner;
        if let Some(old) = inner.map.remove(&key) {
            inner.order.remove(&old.seq);
            inner.bytes -= old.size;
        }
        while inner.map.len() >= self.max_entries || inner.bytes + size > self.max_bytes {
            let Some((_, oldest)) = inner.order.pop_first() else {
                break;
            };
            if let Some(e) = inner.map.remove(&oldest) {
                inner.bytes -= e.size;
            }
        }
        let seq = inner.next;
        inner.next += 1;
        let expires = now + Duration::from_secs(u64::from(ttl.min(MAX_TTL)));
        inner.order.insert(seq, key.clone());
        inner.bytes += size;
        inner.map.insert(
            key,
            Entry {
                wire,
                stored: now,
                expires,
                seq,
                size,
            },
        );
    }

    /// (entries, bytes) held.
    pub fn usage(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.map.len(), inner.bytes)
    }
}

/// How long an upstream answer may be cached, if at all.
pub fn cache_ttl(msg: &Message) -> Option<u32> {
    if msg.metadata.truncation {
        return None;
    }
    let code = msg.metadata.response_code;
    let negative =
        code == ResponseCode::NXDomain || (code == ResponseCode::NoError && msg.answers.is_empty());
    if negative {
        // RFC 2308: the SOA's TTL, at most its MINIMUM field. No SOA, no caching.
        return msg.authorities.iter().find_map(|r| match &r.data {
            RData::SOA(soa) => Some(r.ttl.min(soa.minimum)),
            _ => None,
        });
    }
    if code != ResponseCode::NoError {
        return None;
    }
    msg.answers
        .iter()
        .chain(msg.authorities.iter())
        .map(|r| r.ttl)
        .min()
}

/// Counts the TTLs of a cached answer down by its age.
pub fn age_ttls(msg: &mut Message, age: Duration) {
    let secs = u32::try_from(age.as_secs()).unwrap_or(u32::MAX);
    for r in msg
        .answers
        .iter_mut()
        .chain(msg.authorities.iter_mut())
        .chain(msg.additionals.iter_mut())
    {
        r.ttl = r.ttl.saturating_sub(secs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: &str) -> CacheKey {
        CacheKey {
            name: format!("{n}."),
            qtype: RecordType::A,
            qclass: DNSClass::IN,
            dnssec_ok: false,
            checking_disabled: false,
        }
    }

    #[test]
    fn honours_ttl_and_counts_age() {
        let c = Cache::new(10, 1 << 20);
        let t0 = Instant::now();
        c.insert(key("a"), vec![1; 40], 5, t0);
        let hit = c.get(&key("a"), t0 + Duration::from_secs(3)).unwrap();
        assert_eq!(hit.wire, vec![1; 40]);
        assert_eq!(hit.age, Duration::from_secs(3));
        assert!(
            c.get(&key("a"), t0 + Duration::from_secs(5)).is_none(),
            "expired at its TTL"
        );
        assert_eq!(c.usage(), (0, 0), "an expired entry is dropped when met");
        // A TTL over the cap is cut to it; zero is not cached.
        c.insert(key("b"), vec![1; 40], 86400, t0);
        assert!(c
            .get(&key("b"), t0 + Duration::from_secs(u64::from(MAX_TTL)))
            .is_none());
        c.insert(key("z"), vec![1; 40], 0, t0);
        assert!(c.get(&key("z"), t0).is_none());
    }

    #[test]
    fn bounded_by_entries_least_recently_used_first() {
        let c = Cache::new(3, 1 << 20);
        let t0 = Instant::now();
        for n in ["a", "b", "c"] {
            c.insert(key(n), vec![0; 10], 60, t0);
        }
        assert!(c.get(&key("a"), t0).is_some()); // a is now the most recent
        c.insert(key("d"), vec![0; 10], 60, t0);
        assert_eq!(c.usage().0, 3);
        assert!(
            c.get(&key("b"), t0).is_none(),
            "b was the least recently used"
        );
        for n in ["a", "c", "d"] {
            assert!(c.get(&key(n), t0).is_some(), "{n}");
        }
    }

    #[test]
    fn bounded_by_bytes() {
        let size = |wire: usize| wire + "x.".len() + ENTRY_OVERHEAD;
        let c = Cache::new(1000, 3 * size(100));
        let t0 = Instant::now();
        for n in ["a", "b", "c", "d", "e"] {
            c.insert(key(n), vec![0; 100], 60, t0);
            assert!(c.usage().1 <= 3 * size(100));
        }
        assert_eq!(c.usage(), (3, 3 * size(100)));
        // Too big for the whole cache: refused, nothing evicted for it.
        c.insert(key("huge"), vec![0; 1000], 60, t0);
        assert_eq!(c.usage().0, 3);
        assert!(c.get(&key("huge"), t0).is_none());
        // Replacing an entry does not count it twice.
        c.insert(key("e"), vec![0; 100], 60, t0);
        assert_eq!(c.usage(), (3, 3 * size(100)));
        // Disabled.
        let off = Cache::new(0, 1 << 20);
        off.insert(key("a"), vec![0; 10], 60, t0);
        assert_eq!(off.usage(), (0, 0));
    }

    #[test]
    fn ttl_of_answers() {
        use hickory_proto::op::{MessageType, OpCode};
        use hickory_proto::rr::rdata::{A, SOA};
        use hickory_proto::rr::{Name, Record};
        let name = Name::from_ascii("x.example.").unwrap();
        let mut m = Message::new(1, MessageType::Response, OpCode::Query);
        m.answers.push(Record::from_rdata(
            name.clone(),
            120,
            RData::A(A::new(1, 2, 3, 4)),
        ));
        m.answers.push(Record::from_rdata(
            name.clone(),
            60,
            RData::A(A::new(1, 2, 3, 5)),
        ));
        assert_eq!(cache_ttl(&m), Some(60));
        m.metadata.truncation = true;
        assert_eq!(cache_ttl(&m), None);
        let mut nx = Message::new(1, MessageType::Response, OpCode::Query);
        nx.metadata.response_code = ResponseCode::NXDomain;
        assert_eq!(cache_ttl(&nx), None, "no SOA: not cached");
        let soa = SOA::new(name.clone(), name.clone(), 1, 2, 3, 4, 10);
        nx.authorities
            .push(Record::from_rdata(name.clone(), 900, RData::SOA(soa)));
        assert_eq!(cache_ttl(&nx), Some(10));
        let mut fail = Message::new(1, MessageType::Response, OpCode::Query);
        fail.metadata.response_code = ResponseCode::ServFail;
        assert_eq!(cache_ttl(&fail), None);
        age_ttls(&mut m, Duration::from_secs(100));
        assert_eq!(
            m.answers.iter().map(|r| r.ttl).collect::<Vec<_>>(),
            vec![20, 0]
        );
    }
}
