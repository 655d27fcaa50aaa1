//! CIDR ranges for `control_target_cidrs`.

use core::fmt;
use std::net::IpAddr;

/// An IPv4 or IPv6 network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    net: IpAddr,
    len: u8,
}

impl Cidr {
    /// Parses `a.b.c.d/n`, `x::y/n`, or a bare address (a single host). Host bits must
    /// be zero.
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let net: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not an IP address or CIDR"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let len = match len {
            None => max,
            Some(l) => match l.trim().parse::<u8>() {
                Ok(n) if n <= max => n,
                _ => return Err(format!("{s:?}: prefix length must be 0..={max}")),
            },
        };
        let c = Cidr { net, len };
        if c.mask(net) != net {
            return Err(format!(
                "{s:?}: host bits are set (did you mean {}/{len}?)",
                c.mask(net)
            ));
        }
        Ok(c)
    }

    fn mask(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(v4) => {
                let bits = u32::from(v4);
                let m = if self.len == 0 {
                    0
                } else {
                    u32::MAX << (32 - u32::from(self.len))
                };
                IpAddr::V4((bits & m).into())
            }
            IpAddr::V6(v6) => {
                let bits = u128::from(v6);
                let m = if self.len == 0 {
                    0
                } else {
                    u128::MAX << (128 - u32::from(self.len))
                };
                IpAddr::V6((bits & m).into())
            }
        }
    }

    /// Whether `ip` is inside this network (IPv4-mapped IPv6 addresses match IPv4
    /// networks).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        if ip.is_ipv4() != self.net.is_ipv4() {
            return false;
        }
        self.mask(ip) == self.net
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.net, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn v4() {
        let c = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(c.contains(ip("10.1.2.3")));
        assert!(!c.contains(ip("11.0.0.1")));
        assert!(c.contains(ip("::ffff:10.9.9.9")));
        assert!(!c.contains(ip("fd00::1")));
        let all = Cidr::parse("0.0.0.0/0").unwrap();
        assert!(all.contains(ip("1.2.3.4")));
        let host = Cidr::parse("127.0.0.1").unwrap();
        assert!(host.contains(ip("127.0.0.1")) && !host.contains(ip("127.0.0.2")));
        assert_eq!(host.to_string(), "127.0.0.1/32");
    }

    #[test]
    fn v6() {
        let c = Cidr::parse("fd00::/8").unwrap();
        assert!(c.contains(ip("fd12::1")));
        assert!(!c.contains(ip("fe80::1")));
        assert!(!c.contains(ip("10.0.0.1")));
        assert!(Cidr::parse("::/0").unwrap().contains(ip("::1")));
    }

    #[test]
    fn errors() {
        assert!(Cidr::parse("10.0.0.1/8")
            .unwrap_err()
            .contains("10.0.0.0/8"));
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("fd00::/129").is_err());
        assert!(Cidr::parse("host/8").is_err());
        assert!(Cidr::parse("10.0.0.0/x").is_err());
        assert!(Cidr::parse("").is_err());
    }
}
