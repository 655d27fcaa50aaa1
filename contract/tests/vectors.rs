//! Pins the wire formats to vectors computed by an independent implementation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use kvguard_contract::{signature, stamp, AbortReason, AbortRequest, Key, RequestId};
use serde_json::Value;

fn vectors() -> Value {
    serde_json::from_str(include_str!("vectors.json")).unwrap()
}

#[test]
fn signature_vectors() {
    let v = vectors();
    for case in v["signature"].as_array().unwrap() {
        let key = Key::try_new(case["key"].as_str().unwrap().as_bytes()).unwrap();
        let t = case["t"].as_u64().unwrap();
        let body = case["body"].as_str().unwrap().as_bytes();
        let header = case["header"].as_str().unwrap();
        assert_eq!(signature::sign(&key, t, body), header);
        assert!(signature::verify(&[key], Some(header.as_bytes()), body, t).is_ok());
    }
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
