//! Liveness leases (contract §8): a gateway process's instance id, the header that tags
//! its requests with it, and the signed renewal `POST /v1/lease`.

use crate::hex;
use core::fmt;
use serde::{Deserialize, Serialize};

/// The request header naming the gateway process that carries the request. The filter
/// overwrites any client copy on every tracked request (and strips it from the others).
pub const INSTANCE_HEADER: &str = "x-kvguard-instance";

/// Path of the renewal endpoint on kvguard-control's admin listener.
pub const LEASE_PATH: &str = "/v1/lease";

/// Largest renewal body kvguard-control reads, in bytes.
pub const MAX_RENEWAL_BODY: usize = 512;

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

/// The renewal body: `{"instance":"<32 hex>","counter":<u64>}`. `counter` grows with
/// every renewal the process sends (any of its worker VMs); kvguard-control accepts a
/// renewal only if its counter is above the last one it accepted for that instance, so a
/// replay is refused whatever the clocks say. Unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Renewal {
    /// The instance id, 32 hex digits.
    pub instance: String,
    /// The per-sender counter.
    pub counter: u64,
}

impl Renewal {
    /// A renewal of `instance` with `counter`.
    pub fn new(instance: InstanceId, counter: u64) -> Renewal {
        Renewal {
            instance: instance.to_string(),
            counter,
        }
    }

    /// Compact JSON.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses and validates a body.
    pub fn parse(body: &[u8]) -> Option<(InstanceId, u64)> {
        if body.len() > MAX_RENEWAL_BODY {
            return None;
        }
        let r: Renewal = serde_json::from_slice(body).ok()?;
        Some((InstanceId::parse(r.instance.as_bytes())?, r.counter))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(Renewal::parse(&body), Some((id, 7)));
        assert_eq!(Renewal::parse(br#"{"instance":"x","counter":1}"#), None);
        assert_eq!(Renewal::parse(&[b' '; 600]), None);
    }

    #[test]
    fn a_renewal_of_exactly_max_renewal_body_bytes_is_read_and_one_more_is_refused() {
        let id = InstanceId([0x5a; 16]);
        let padded = |len: usize| {
            let mut body = Renewal::new(id, 9).to_json();
            body.resize(len, b' ');
            body
        };
        assert_eq!(MAX_RENEWAL_BODY, 512);
        assert_eq!(Renewal::parse(&padded(MAX_RENEWAL_BODY)), Some((id, 9)));
        assert_eq!(Renewal::parse(&padded(MAX_RENEWAL_BODY + 1)), None);
        assert_eq!(Renewal::parse(&padded(MAX_RENEWAL_BODY + 100)), None);
    }
}
