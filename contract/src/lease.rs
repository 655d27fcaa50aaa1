//! Liveness leases (contract §8): a gateway process's instance id, the header that tags
//! its requests with it, the host key that survives its restarts, and the signed renewal
//! it sends out of band (`POST /v1/lease`, admin listener) and in band
//! (`POST /v1/kvguard/lease`, over its upstream cluster, answered by kvguard-control's
//! proxy listener).

use crate::hex;
use crate::key::Key;
use core::fmt;
use core::net::SocketAddr;
use serde::Deserialize;

/// What a proof's MAC input starts with (its domain, as [`Domain`] prefixes the other
/// signed kinds: ends in the only NUL, starts none of theirs).
pub const PROOF_DOMAIN: &[u8] = b"kvguard-proof-v2\0";

/// The fixed key of [`HostKey::derive`] (domain separation, not a secret).
const HOST_KEY_DOMAIN: &[u8] = b"kvguard.host-key.v1";

/// The request header naming the gateway process that carries the request, and the
/// worker VM within it: `<32 hex>` or `<32 hex>.<vm>` ([`InstanceTag`]), from filters that
/// prove their life on requests followed by a signed [`Proof`]. The filter overwrites any
/// client copy on every tracked request (and strips it from the others).
pub const INSTANCE_HEADER: &str = "x-kvguard-instance";

/// Longest [`INSTANCE_HEADER`] value read (a longer one is no tag).
pub const MAX_TAG_VALUE: usize = 256;

/// Most VM ids one renewal lists (a longer list is unreadable).
pub const MAX_VMS: usize = 1024;

/// Path of the out-of-band renewal endpoint on kvguard-control's admin listener.
pub const LEASE_PATH: &str = "/v1/lease";

/// Path of the in-band renewal on kvguard-control's proxy listener: sent over the
/// gateway's upstream cluster, through every hop its streams take, and answered by
/// kvguard-control itself (never proxied to the engine). Under `/v1/` so hops that admit
/// the OpenAI prefix pass it.
pub const DATA_LEASE_PATH: &str = "/v1/kvguard/lease";

/// Largest renewal body kvguard-control reads, in bytes (512 before the `vms` list:
/// such a control refuses a longer body, which only a gateway with more than about 80
/// worker VMs sends).
pub const MAX_RENEWAL_BODY: usize = 2048;

/// The shortest TTL kvguard-control accepts, in renewal periods: a lease survives two
/// lost renewals in a row.
pub const MIN_TTL_PERIODS: u32 = 3;

/// A gateway process's 128-bit random id (32 lowercase hex digits on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceId(pub [u8; 16]);

impl InstanceId {
    /// Parses 32 hex digits.
    pub fn parse(text: &[u8]) -> Option<InstanceId> {
        hex::decode16(text.trim_ascii()).map(InstanceId)
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(&self.0))
    }
}

/// The value of [`INSTANCE_HEADER`]: the gateway process and, from filters that number
/// their worker VMs, the VM that carries the request (`<32 hex>.<vm>`, `vm` decimal,
/// 1 or more). The VM lets kvguard-control end the streams of one VM the process no
/// longer lists as live (a trapped VM) while the process renews.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceTag {
    /// The gateway process.
    pub instance: InstanceId,
    /// The worker VM within it (`None` from older filters).
    pub vm: Option<u32>,
}

impl InstanceTag {
    /// Parses `<32 hex>` or `<32 hex>.<vm>` (`None` for anything else, a VM id of 0
    /// included).
    pub fn parse(text: &[u8]) -> Option<InstanceTag> {
        let text = text.trim_ascii();
        let (id, vm) = match text.iter().position(|b| *b == b'.') {
            Some(i) => (&text[..i], Some(parse_vm(&text[i + 1..])?)),
            None => (text, None),
        };
        Some(InstanceTag {
            instance: InstanceId::parse(id)?,
            vm,
        })
    }
}

impl From<InstanceId> for InstanceTag {
    fn from(instance: InstanceId) -> InstanceTag {
        InstanceTag { instance, vm: None }
    }
}

impl fmt::Display for InstanceTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.vm {
            Some(vm) => write!(f, "{}.{vm}", self.instance),
            None => write!(f, "{}", self.instance),
        }
    }
}

/// A VM id: decimal digits only, 1 or more.
fn parse_vm(text: &[u8]) -> Option<u32> {
    if text.is_empty() || text.len() > 10 || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    core::str::from_utf8(text)
        .ok()?
        .parse()
        .ok()
        .filter(|v| *v > 0)
}

/// The `vms` value of a renewal: the VM ids, comma-separated, in any order.
pub fn vms_value(vms: &[u32]) -> String {
    let mut s = String::new();
    for v in vms {
        if !s.is_empty() {
            s.push(',');
        }
        s.push_str(&v.to_string());
    }
    s
}

/// Reads a `vms` value (`None`: an id that is not one, or more than [`MAX_VMS`] ids).
pub fn parse_vms(text: &str) -> Option<Vec<u32>> {
    if text.is_empty() {
        return Some(Vec::new());
    }
    let ids: Option<Vec<u32>> = text.split(',').map(|v| parse_vm(v.as_bytes())).collect();
    ids.filter(|v| v.len() <= MAX_VMS)
}

/// What stays the same when a gateway process is replaced on the same host: a hash of
/// Envoy's node id and the filter's VM id (32 hex digits on the wire). A crash restart in
/// place, a hot restart's child and a pod restarted with its identity all renew with the
/// host key of the process they replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostKey(pub [u8; 16]);

impl HostKey {
    /// The host key of Envoy node `node_id` running the filter in VM `vm_id`: the first
    /// 16 bytes of HMAC-SHA256 under a fixed, public key (a hash; the HMAC the crate
    /// already has keeps the filter's module small).
    pub fn derive(node_id: &[u8], vm_id: &[u8]) -> HostKey {
        let len = (node_id.len() as u64).to_be_bytes();
        let d = Key(HOST_KEY_DOMAIN.to_vec()).mac_unprefixed(&[&len, node_id, vm_id]);
        let mut k = [0u8; 16];
        k.copy_from_slice(&d[..16]);
        HostKey(k)
    }

    /// Parses 32 hex digits.
    pub fn parse(text: &[u8]) -> Option<HostKey> {
        hex::decode16(text.trim_ascii()).map(HostKey)
    }
}

impl fmt::Display for HostKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(&self.0))
    }
}

/// The path a renewal travelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// Out of band, to the admin listener (`control_cluster` or one replica).
    Admin,
    /// In band, over the upstream cluster the gateway's streams use.
    Data,
}

impl Via {
    /// The wire and label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Via::Admin => "admin",
            Via::Data => "data",
        }
    }
}

const fn yes() -> bool {
    true
}

/// The renewal body:
/// `{"instance":"<32 hex>","counter":<u64>,"host":"<32 hex>","period_ms":<u64>,"via":"data","fanout":false}`.
///
/// `counter` grows with every renewal the process sends (any of its worker VMs); the
/// same period's renewal carries the same counter on every path. `via` says which path
/// it was sent on (signed, so a renewal captured on one path cannot be passed off on the
/// other; absent = `admin`); `fanout: false` marks a renewal sent to every replica
/// directly, which the receiver does not forward to its peers (absent = `true`).
/// `host` and `period_ms` are optional for older senders. `vms` ([`vms_value`]) lists the
/// worker VMs of the process that are live (absent from older senders: no VM is judged).
/// Unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Renewal {
    /// The instance id, 32 hex digits.
    pub instance: String,
    /// The per-sender counter.
    pub counter: u64,
    /// The host key, 32 hex digits.
    #[serde(default)]
    pub host: Option<String>,
    /// The sender's renewal period.
    #[serde(default)]
    pub period_ms: Option<u64>,
    /// The path it was sent on.
    #[serde(default = "admin")]
    pub via: Via,
    /// Whether the receiver forwards it to its peers.
    #[serde(default = "yes")]
    pub fanout: bool,
    /// The live worker VMs.
    #[serde(default)]
    pub vms: Option<String>,
}

const fn admin() -> Via {
    Via::Admin
}

/// A parsed and validated renewal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenewalBody {
    /// The renewing process.
    pub instance: InstanceId,
    /// Its counter.
    pub counter: u64,
    /// Its host key (`None` from an older sender).
    pub host: Option<HostKey>,
    /// Its renewal period, ms (`None` from an older sender).
    pub period_ms: Option<u64>,
    /// The path it was sent on.
    pub via: Via,
    /// Whether the receiver forwards it to its peers.
    pub fanout: bool,
    /// The live worker VMs (`None` from an older sender).
    pub vms: Option<Vec<u32>>,
}

impl Renewal {
    /// An out-of-band renewal of `instance` with `counter` (no host key, no period).
    pub fn new(instance: InstanceId, counter: u64) -> Renewal {
        Renewal {
            instance: instance.to_string(),
            counter,
            host: None,
            period_ms: None,
            via: Via::Admin,
            fanout: true,
            vms: None,
        }
    }

    /// This renewal listing `vms` as the process's live worker VMs.
    pub fn with_vms(mut self, vms: &[u32]) -> Renewal {
        self.vms = Some(vms_value(vms));
        self
    }

    /// This renewal with `host` and `period_ms`.
    pub fn from_host(mut self, host: HostKey, period_ms: u64) -> Renewal {
        self.host = Some(host.to_string());
        self.period_ms = Some(period_ms);
        self
    }

    /// This renewal sent on `via`, forwarded to peers or not.
    pub fn sent(mut self, via: Via, fanout: bool) -> Renewal {
        self.via = via;
        self.fanout = fanout;
        self
    }

    /// Compact JSON, optional fields only where they differ from their defaults
    /// (written by hand: the filter's module is size-bound, and every value here is
    /// digits, hex or a fixed word, so nothing needs escaping).
    pub fn to_json(&self) -> Vec<u8> {
        let mut s = format!(
            r#"{{"instance":"{}","counter":{}"#,
            self.instance, self.counter
        );
        if let Some(h) = &self.host {
            s.push_str(&format!(r#","host":"{h}""#));
        }
        if let Some(p) = self.period_ms {
            s.push_str(&format!(r#","period_ms":{p}"#));
        }
        if self.via != Via::Admin {
            s.push_str(&format!(r#","via":"{}""#, self.via.as_str()));
        }
        if !self.fanout {
            s.push_str(r#","fanout":false"#);
        }
        if let Some(v) = &self.vms {
            s.push_str(&format!(r#","vms":"{v}""#));
        }
        s.push('}');
        s.into_bytes()
    }

    /// Parses and validates a body (`None`: too long, not JSON, a bad instance or host
    /// key, a zero period, an unreadable `vms`).
    pub fn parse(body: &[u8]) -> Option<RenewalBody> {
        if body.len() > MAX_RENEWAL_BODY {
            return None;
        }
        let r: Renewal = serde_json::from_slice(body).ok()?;
        let host = match &r.host {
            Some(h) => Some(HostKey::parse(h.as_bytes())?),
            None => None,
        };
        if r.period_ms == Some(0) {
            return None;
        }
        let vms = match &r.vms {
            Some(v) => Some(parse_vms(v)?),
            None => None,
        };
        Some(RenewalBody {
            instance: InstanceId::parse(r.instance.as_bytes())?,
            counter: r.counter,
            host,
            period_ms: r.period_ms,
            via: r.via,
            fanout: r.fanout,
            vms,
        })
    }
}

/// A gateway's proof of life on a tracked request: the value of [`INSTANCE_HEADER`] is
/// `<tag>;c=<counter>;h=<host key, 32 hex, or ->;a=<listener ip:port or ->;s=<64 hex>`,
/// `s` being HMAC-SHA256 under the filter's first key of [`PROOF_DOMAIN`] and
/// everything before `;s=`. It is an in-band renewal that needs no path of its own: it
/// travels on the requests themselves, through every hop that passes the header. The
/// counter is the lease counter of the period (one proof per period: a repeated or older
/// counter is no new evidence), so a captured value replayed proves nothing new.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proof {
    /// The process's lease counter when the proof was made (its last renewal slot).
    pub counter: u64,
    /// Its host key.
    pub host: Option<HostKey>,
    /// The gateway listener's own address, as a tracked request arrived on it (Envoy's
    /// `destination.address`): where kvguard-control may ask the gateway's kernel
    /// whether anything still listens.
    pub listener: Option<SocketAddr>,
}

impl Proof {
    /// The [`INSTANCE_HEADER`] value carrying `tag` and this proof, signed with `key`.
    pub fn value(&self, tag: InstanceTag, key: &Key) -> String {
        let listener = self.listener.map(|a| a.to_string());
        let v = sign_proof(
            key,
            unsigned_proof(
                tag,
                self.counter,
                self.host,
                listener.as_ref().map(String::as_bytes),
            ),
        );
        String::from_utf8_lossy(&v).into_owned()
    }
}

/// What a proof signs: `<tag>;c=<counter>;h=<host or ->;a=<listener or ->` (the
/// listener as Envoy wrote it; one that is not `ip:port` reads as none).
pub fn unsigned_proof(
    tag: InstanceTag,
    counter: u64,
    host: Option<HostKey>,
    listener: Option<&[u8]>,
) -> Vec<u8> {
    let mut v = match host {
        Some(h) => format!("{tag};c={counter};h={h};a="),
        None => format!("{tag};c={counter};h=-;a="),
    }
    .into_bytes();
    v.extend_from_slice(listener.unwrap_or(b"-"));
    v
}

/// `unsigned` ([`unsigned_proof`]) with its signature under `key` appended (`;s=<hex>`).
pub fn sign_proof(key: &Key, mut unsigned: Vec<u8>) -> Vec<u8> {
    let mac = key.mac_unprefixed(&[PROOF_DOMAIN, &unsigned]);
    unsigned.extend_from_slice(b";s=");
    unsigned.extend_from_slice(hex::encode(&mac).as_bytes());
    unsigned
}

/// A [`Proof`] as read from a header, with what its signature covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedProof<'a> {
    /// The proof.
    pub proof: Proof,
    /// The signed bytes (everything before `;s=`).
    pub signed: &'a [u8],
    /// The MAC.
    pub mac: [u8; 32],
}

impl SignedProof<'_> {
    /// Whether its MAC is right under one of `keys` (every key is tried: the time taken
    /// does not say which one matched).
    pub fn verify(&self, keys: &[Key]) -> bool {
        let mut ok = false;
        for k in keys {
            let mac = k.mac_unprefixed(&[PROOF_DOMAIN, self.signed]);
            // Every byte compared: the time taken does not say where they differ.
            ok |= mac.iter().zip(&self.mac).fold(0, |d, (a, b)| d | (a ^ b)) == 0;
        }
        ok
    }
}

/// A parsed [`INSTANCE_HEADER`] value: the tag, and the proof when the filter sent one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagHeader<'a> {
    /// The gateway process and worker VM.
    pub tag: InstanceTag,
    /// Its signed proof of life (`None` from filters that send the tag alone).
    pub proof: Option<SignedProof<'a>>,
}

impl<'a> TagHeader<'a> {
    /// Parses `<tag>` or `<tag>;c=..;h=..;a=..;s=..` (fields between the tag and `s` in
    /// any order; unknown ones are signed and ignored). `None` for anything else.
    pub fn parse(text: &'a [u8]) -> Option<TagHeader<'a>> {
        let text = text.trim_ascii();
        if text.len() > MAX_TAG_VALUE {
            return None;
        }
        let Some(end) = text.iter().position(|b| *b == b';') else {
            return Some(TagHeader {
                tag: InstanceTag::parse(text)?,
                proof: None,
            });
        };
        let tag = InstanceTag::parse(&text[..end])?;
        let at = text.windows(3).rposition(|w| w == b";s=")?;
        let mac = hex::decode32(&text[at + 3..])?;
        let signed = &text[..at];
        let (mut counter, mut host, mut listener) = (None, None, None);
        for field in signed[end + 1..].split(|b| *b == b';') {
            let text = core::str::from_utf8(field).ok()?;
            let (k, v) = text.split_once('=')?;
            match k {
                "c" if counter.is_none() => counter = Some(v.parse::<u64>().ok()?),
                "h" if host.is_none() => {
                    host = Some(if v == "-" {
                        None
                    } else {
                        Some(HostKey::parse(v.as_bytes())?)
                    })
                }
                // Not `ip:port` (a pipe, or an address Envoy writes otherwise): no listener
                // to ask; the proof stands.
                "a" if listener.is_none() => listener = Some(v.parse().ok()),
                "c" | "h" | "a" => return None,
                _ => {}
            }
        }
        Some(TagHeader {
            tag,
            proof: Some(SignedProof {
                proof: Proof {
                    counter: counter?,
                    host: host.flatten(),
                    listener: listener.flatten(),
                },
                signed,
                mac,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Domain;

    #[test]
    fn instance_and_body_round_trip() {
        let id = InstanceId([0xab; 16]);
        assert_eq!(id.to_string(), "ab".repeat(16));
        assert_eq!(InstanceId::parse(id.to_string().as_bytes()), Some(id));
        assert_eq!(InstanceId::parse(b"abc"), None);
        assert_eq!(InstanceId::parse(&[b'z'; 32]), None);
        let body = Renewal::new(id, 7).to_json();
        assert_eq!(
            body,
            format!(r#"{{"instance":"{}","counter":7}}"#, "ab".repeat(16)).into_bytes()
        );
        let parsed = Renewal::parse(&body).unwrap();
        assert_eq!((parsed.instance, parsed.counter), (id, 7));
        assert_eq!((parsed.host, parsed.period_ms), (None, None));
        assert_eq!((parsed.via, parsed.fanout), (Via::Admin, true));
        assert_eq!(Renewal::parse(br#"{"instance":"x","counter":1}"#), None);
        assert_eq!(Renewal::parse(&[b' '; 600]), None);
    }

    #[test]
    fn host_period_path_and_fanout_round_trip() {
        let id = InstanceId([1; 16]);
        let host = HostKey::derive(b"router~10.0.0.1~gw-0.ns~ns.svc.cluster.local", b"kvguard");
        let body = Renewal::new(id, 9)
            .from_host(host, 5000)
            .sent(Via::Data, false)
            .to_json();
        let text = String::from_utf8(body.clone()).unwrap();
        assert!(text.contains(r#""via":"data""#) && text.contains(r#""fanout":false"#));
        assert_eq!(
            Renewal::parse(&body),
            Some(RenewalBody {
                instance: id,
                counter: 9,
                host: Some(host),
                period_ms: Some(5000),
                via: Via::Data,
                fanout: false,
                vms: None,
            })
        );
        let bad_host = format!(r#"{{"instance":"{id}","counter":1,"host":"zz"}}"#);
        assert_eq!(Renewal::parse(bad_host.as_bytes()), None);
        let zero = format!(r#"{{"instance":"{id}","counter":1,"period_ms":0}}"#);
        assert_eq!(Renewal::parse(zero.as_bytes()), None);
        let bad_via = format!(r#"{{"instance":"{id}","counter":1,"via":"carrier-pigeon"}}"#);
        assert_eq!(Renewal::parse(bad_via.as_bytes()), None);
    }

    #[test]
    fn a_host_key_depends_on_the_node_and_the_vm_only() {
        let a = HostKey::derive(b"node-a", b"vm");
        assert_eq!(a, HostKey::derive(b"node-a", b"vm"));
        assert_ne!(a, HostKey::derive(b"node-b", b"vm"));
        assert_ne!(a, HostKey::derive(b"node-a", b"vm2"));
        // The node id's length is hashed: moving bytes between the two parts changes it.
        assert_ne!(
            HostKey::derive(b"node-a", b"vm"),
            HostKey::derive(b"node-av", b"m")
        );
        assert_eq!(HostKey::parse(a.to_string().as_bytes()), Some(a));
    }

    #[test]
    fn a_renewal_of_exactly_max_renewal_body_bytes_is_read_and_one_more_is_refused() {
        let id = InstanceId([0x5a; 16]);
        let padded = |len: usize| {
            let mut body = Renewal::new(id, 9).to_json();
            body.resize(len, b' ');
            body
        };
        assert_eq!(MAX_RENEWAL_BODY, 2048);
        assert_eq!(
            Renewal::parse(&padded(MAX_RENEWAL_BODY)).map(|r| r.counter),
            Some(9)
        );
        assert_eq!(Renewal::parse(&padded(MAX_RENEWAL_BODY + 1)), None);
        assert_eq!(Renewal::parse(&padded(MAX_RENEWAL_BODY + 100)), None);
    }

    #[test]
    fn an_instance_tag_names_the_vm_or_not() {
        let id = InstanceId([0xab; 16]);
        let old = InstanceTag::parse(id.to_string().as_bytes()).unwrap();
        assert_eq!(
            old,
            InstanceTag {
                instance: id,
                vm: None
            }
        );
        let t = InstanceTag {
            instance: id,
            vm: Some(42),
        };
        assert_eq!(t.to_string(), format!("{id}.42"));
        assert_eq!(InstanceTag::parse(t.to_string().as_bytes()), Some(t));
        assert_eq!(old.to_string(), id.to_string());
        // Digits only (Rust's parse would take "+1"), at most 10 of them.
        for bad in [
            ".1",
            "0",
            "",
            "x",
            "1.",
            "-1",
            "+1",
            "4294967296",
            "00000000001",
        ] {
            let text = format!("{id}.{bad}");
            assert_eq!(InstanceTag::parse(text.as_bytes()), None, "{text}");
        }
        assert_eq!(InstanceTag::parse(b"abc.1"), None);
        let max = format!("{id}.4294967295");
        assert_eq!(
            InstanceTag::parse(max.as_bytes()).unwrap().vm,
            Some(u32::MAX)
        );
    }

    #[test]
    fn the_vm_list_round_trips_and_is_bounded() {
        assert_eq!(vms_value(&[]), "");
        assert_eq!(vms_value(&[3, 1, 12]), "3,1,12");
        assert_eq!(parse_vms("3,1,12"), Some(vec![3, 1, 12]));
        assert_eq!(parse_vms(""), Some(vec![]));
        for bad in ["0", "a", "1,", ",1", "1,,2", "-2", "1-2"] {
            assert_eq!(parse_vms(bad), None, "{bad}");
        }
        let most: Vec<u32> = (1..=MAX_VMS as u32).collect();
        assert_eq!(parse_vms(&vms_value(&most)).map(|v| v.len()), Some(MAX_VMS));
        let over: Vec<u32> = (1..=MAX_VMS as u32 + 1).collect();
        assert_eq!(parse_vms(&vms_value(&over)), None);
        let id = InstanceId([1; 16]);
        let body = Renewal::new(id, 3).with_vms(&[2, 1, 4]).to_json();
        assert!(String::from_utf8(body.clone())
            .unwrap()
            .ends_with(r#","vms":"2,1,4"}"#));
        assert_eq!(Renewal::parse(&body).unwrap().vms, Some(vec![2, 1, 4]));
        let bad = format!(r#"{{"instance":"{id}","counter":1,"vms":"0"}}"#);
        assert_eq!(Renewal::parse(bad.as_bytes()), None);
        // An older sender lists none: no VM is judged.
        assert_eq!(
            Renewal::parse(&Renewal::new(id, 3).to_json()).unwrap().vms,
            None
        );
    }
    #[test]
    fn a_proof_round_trips_and_verifies_under_its_key_only() {
        let key = Key::try_new(b"0123456789abcdef-proof").unwrap();
        let other = Key::try_new(b"another key, 16+ bytes").unwrap();
        let tag = InstanceTag {
            instance: InstanceId([0xab; 16]),
            vm: Some(3),
        };
        let proof = Proof {
            counter: 42,
            host: Some(HostKey([7; 16])),
            listener: Some("10.1.2.3:8080".parse().unwrap()),
        };
        let v = proof.value(tag, &key);
        assert!(v.starts_with(&format!(
            "{tag};c=42;h={};a=10.1.2.3:8080;s=",
            "07".repeat(16)
        )));
        let h = TagHeader::parse(v.as_bytes()).unwrap();
        assert_eq!(h.tag, tag);
        let p = h.proof.unwrap();
        assert_eq!(p.proof, proof);
        assert!(p.verify(std::slice::from_ref(&key)));
        assert!(p.verify(&[other.clone(), key.clone()]));
        assert!(!p.verify(std::slice::from_ref(&other)));
        assert!(!p.verify(&[]));
        // Any change to the MAC breaks it, also two that would cancel out in a XOR.
        let mut twice = p.clone();
        twice.mac[0] ^= 1;
        twice.mac[1] ^= 1;
        assert!(!twice.verify(std::slice::from_ref(&key)));
        // Any change to what is signed breaks it.
        let forged = v.replace(";c=42;", ";c=43;");
        let f = TagHeader::parse(forged.as_bytes()).unwrap().proof.unwrap();
        assert!(!f.verify(std::slice::from_ref(&key)));
        // The MAC is under the proof's own domain.
        let signed = v.split(";s=").next().unwrap();
        assert_eq!(
            p.mac,
            key.mac_unprefixed(&[PROOF_DOMAIN, signed.as_bytes()]),
            "{v}"
        );
        assert_ne!(p.mac, key.mac(Domain::Renewal, &[signed.as_bytes()]));
        // Its domain is its own: none of the others starts it, it starts none of them.
        for d in Domain::ALL {
            assert!(!d.prefix().starts_with(PROOF_DOMAIN) && !PROOF_DOMAIN.starts_with(d.prefix()));
        }
        assert_eq!(PROOF_DOMAIN.iter().filter(|b| **b == 0).count(), 1);
        // No host key, no listener; IPv6.
        let bare = Proof {
            counter: 0,
            host: None,
            listener: None,
        };
        let v = bare.value(tag, &key);
        assert!(v.contains(";c=0;h=-;a=-;s="), "{v}");
        let p = TagHeader::parse(v.as_bytes()).unwrap().proof.unwrap();
        assert_eq!(p.proof, bare);
        let six = Proof {
            listener: Some("[fd00::1]:443".parse().unwrap()),
            ..bare
        };
        let p6 = six.value(tag, &key);
        assert_eq!(
            TagHeader::parse(p6.as_bytes())
                .unwrap()
                .proof
                .unwrap()
                .proof,
            six
        );
    }

    #[test]
    fn a_tag_header_is_the_plain_tag_or_a_well_formed_proof() {
        let id = InstanceId([0xab; 16]);
        let text = format!("{id}.2");
        let plain = TagHeader::parse(text.as_bytes()).unwrap();
        assert_eq!((plain.tag.vm, plain.proof), (Some(2), None));
        let mac = "0".repeat(64);
        let ok = |fields: &str| format!("{id}.1;{fields};s={mac}");
        assert!(TagHeader::parse(ok("c=1;h=-;a=-").as_bytes()).is_some());
        // A listener that is not ip:port is none; the proof stands.
        let text = ok("c=1;a=/run/envoy.sock");
        let p = TagHeader::parse(text.as_bytes()).unwrap();
        assert_eq!(p.proof.unwrap().proof.listener, None);
        // Fields in any order, unknown ones ignored.
        let text = ok("a=-;x=future;c=5");
        let p = TagHeader::parse(text.as_bytes()).unwrap();
        assert_eq!(p.proof.unwrap().proof.counter, 5);
        for bad in [
            ok("h=-;a=-"),
            ok("c=x"),
            ok("c=1;c=2"),
            ok("c=1;h=-;h=-"),
            ok("c=1;a=-;a=-"),
            ok("c=1;h=zz"),
            ok("c=1;novalue"),
            format!("{id}.1;c=1;s=abc"),
            format!("{id}.1;c=1"),
            format!("{id}.0;c=1;s={mac}"),
            format!("{};c=1;s={mac}", "x".repeat(32)),
            format!("{id}.1;c=1;a={};s={mac}", "9".repeat(MAX_TAG_VALUE)),
        ] {
            assert_eq!(TagHeader::parse(bad.as_bytes()), None, "{bad}");
        }
        // At most MAX_TAG_VALUE bytes are read.
        let fill = |n: usize| format!("{id}.1;c=1;x={};s={mac}", "9".repeat(n));
        let base = fill(0).len();
        let longest = fill(MAX_TAG_VALUE - base);
        assert_eq!(longest.len(), MAX_TAG_VALUE);
        assert!(TagHeader::parse(longest.as_bytes()).is_some());
        assert_eq!(
            TagHeader::parse(fill(MAX_TAG_VALUE - base + 1).as_bytes()),
            None
        );
        // An older reader sees no tag in the extended value (and so counts nothing).
        assert_eq!(InstanceTag::parse(ok("c=1").as_bytes()), None);
    }
}
