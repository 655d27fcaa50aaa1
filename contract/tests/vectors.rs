//! Pins the wire formats to vectors computed by an independent implementation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use kvguard_contract::{
    signature, stamp, AbortReason, AbortRequest, Domain, Forwarded, Key, Renewal, RequestId,
};
use serde_json::Value;

fn vectors() -> Value {
    serde_json::from_str(include_str!("vectors.json")).unwrap()
}

fn domain(kind: &str) -> Domain {
    match kind {
        "abort" => Domain::Abort,
        "renewal" => Domain::Renewal,
        "envelope" => Domain::Envelope,
        other => panic!("unknown kind {other}"),
    }
}

#[test]
fn signature_vectors() {
    let v = vectors();
    let cases = v["signature"].as_array().unwrap();
    let mut kinds: Vec<Domain> = Vec::new();
    for case in cases {
        let kind = domain(case["kind"].as_str().unwrap());
        kinds.push(kind);
        let key = Key::try_new(case["key"].as_str().unwrap().as_bytes()).unwrap();
        let t = case["t"].as_u64().unwrap();
        let body = case["body"].as_str().unwrap().as_bytes();
        let header = case["header"].as_str().unwrap();
        assert_eq!(signature::sign(kind, &key, t, body), header);
        for other in Domain::ALL {
            let r = signature::verify(
                other,
                std::slice::from_ref(&key),
                Some(header.as_bytes()),
                body,
                t,
            );
            assert_eq!(r.is_ok(), other == kind, "{kind:?} checked as {other:?}");
        }
    }
    for kind in [Domain::Abort, Domain::Renewal, Domain::Envelope] {
        assert!(kinds.contains(&kind), "no vector for {kind:?}");
    }
}

#[test]
fn the_renewal_and_envelope_vector_bodies_are_what_the_senders_send() {
    let v = vectors();
    let body = |i: usize| {
        v["signature"][i]["body"]
            .as_str()
            .unwrap()
            .as_bytes()
            .to_vec()
    };
    let renewal = Renewal::parse(&body(2)).unwrap();
    let resent = Renewal::new(renewal.instance, renewal.counter)
        .from_host(renewal.host.unwrap(), renewal.period_ms.unwrap())
        .sent(renewal.via, renewal.fanout)
        .to_json();
    assert_eq!(resent, body(2));
    let env = Forwarded::new("10.0.0.1:9902", &body(0)).unwrap();
    assert_eq!(env.to_json(), body(3));
}

#[test]
fn the_vector_body_is_what_the_filter_sends() {
    let id = RequestId::try_new(b"fx-chat").unwrap();
    let body = AbortRequest::new(&id, AbortReason::DownstreamReset, 1234, 7).to_json();
    assert_eq!(
        body,
        vectors()["signature"][0]["body"]
            .as_str()
            .unwrap()
            .as_bytes()
    );
}

#[test]
fn stamp_vectors() {
    let v = vectors();
    for case in v["stamp"].as_array().unwrap() {
        let key = Key::try_new(case["key"].as_str().unwrap().as_bytes()).unwrap();
        let id = RequestId::try_new(case["request_id"].as_str().unwrap().as_bytes()).unwrap();
        let addr = case["addr"].as_str().unwrap().parse().unwrap();
        let header = case["header"].as_str().unwrap();
        assert_eq!(
            stamp::stamp(&key, addr, &id, case["t"].as_u64().unwrap()),
            header
        );
        assert_eq!(
            stamp::verify(&[key], header.as_bytes(), &id).unwrap().addr,
            addr
        );
    }
}

#[test]
fn proof_vectors() {
    use kvguard_contract::{sign_proof, unsigned_proof, HostKey, InstanceId, InstanceTag};
    let v = vectors();
    let cases = v["proof"].as_array().unwrap();
    assert!(cases.len() >= 3);
    for case in cases {
        let key = Key::try_new(case["key"].as_str().unwrap().as_bytes()).unwrap();
        let tag = InstanceTag {
            instance: InstanceId::parse(case["instance"].as_str().unwrap().as_bytes()).unwrap(),
            vm: Some(u32::try_from(case["vm"].as_u64().unwrap()).unwrap()),
        };
        let host = case["host"]
            .as_str()
            .map(|h| HostKey::parse(h.as_bytes()).unwrap());
        let listener = case["listener"].as_str();
        let counter = case["counter"].as_u64().unwrap();
        let header = case["header"].as_str().unwrap();
        // What the filter sends.
        let sent = sign_proof(
            &key,
            unsigned_proof(tag, counter, host, listener.map(str::as_bytes)),
        );
        assert_eq!(sent, header.as_bytes());
        // What kvguard-control reads.
        let read = kvguard_contract::TagHeader::parse(header.as_bytes()).unwrap();
        assert_eq!(read.tag, tag);
        let p = read.proof.unwrap();
        assert!(p.verify(std::slice::from_ref(&key)));
        assert_eq!((p.proof.counter, p.proof.host), (counter, host));
        assert_eq!(p.proof.listener, listener.map(|l| l.parse().unwrap()));
    }
}
