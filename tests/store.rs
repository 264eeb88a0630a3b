//! Integration tests of the rendezvous store: one server, clients in this process.

use lockstep_core::comm::{StoreClient, StoreServer};
use lockstep_core::CommError;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SECRET: &str = "store-test-secret";
const CONNECT: Duration = Duration::from_secs(10);

fn server() -> StoreServer {
    StoreServer::start("127.0.0.1:0", SECRET).expect("start the store")
}

fn client(server: &StoreServer) -> StoreClient {
    StoreClient::connect(server.addr(), SECRET, CONNECT).expect("connect to the store")
}

#[test]
fn set_then_get_returns_the_value() {
    let server = server();
    let c = client(&server);
    assert_eq!(c.addr(), server.addr());
    c.set("alpha", b"one").unwrap();
    assert_eq!(c.get("alpha").unwrap(), b"one");
    // Overwrite; binary and empty values round-trip.
    c.set("alpha", &[0, 255, 7]).unwrap();
    assert_eq!(c.get("alpha").unwrap(), [0, 255, 7]);
    c.set("empty", b"").unwrap();
    assert_eq!(c.get("empty").unwrap(), b"");
    // Visible to another client and to the server itself.
    let other = client(&server);
    assert_eq!(other.get("alpha").unwrap(), [0, 255, 7]);
    assert_eq!(server.peek("alpha").as_deref(), Some(&[0u8, 255, 7][..]));
    assert_eq!(server.peek("absent"), None);
}

#[test]
fn get_waits_for_a_later_set_from_another_thread() {
    let server = server();
    let waiter = client(&server);
    let setter = client(&server);
    let delay = Duration::from_millis(300);
    let started = Instant::now();
    let handle = std::thread::spawn(move || {
        std::thread::sleep(delay);
        setter.set("late", b"arrived").unwrap();
    });
    let value = waiter.get("late").expect("get should wait for the set");
    let waited = started.elapsed();
    handle.join().unwrap();
    assert_eq!(value, b"arrived");
    assert!(
        waited >= delay,
        "get returned after {waited:?}, before the value was set"
    );
}

#[test]
fn wait_get_times_out_with_a_timeout_error() {
    let server = server();
    let c = client(&server);
    let timeout = Duration::from_millis(200);
    let started = Instant::now();
    let err = c
        .wait_get("never-set", timeout)
        .expect_err("nobody sets the key");
    let waited = started.elapsed();
    match &err {
        CommError::Timeout { what, seconds } => {
            assert!(
                what.contains("never-set"),
                "timeout does not name the key: {err}"
            );
            assert!((*seconds - 0.2).abs() < 1e-9, "seconds = {seconds}");
        }
        other => panic!("expected CommError::Timeout, got {other:?}"),
    }
    assert!(waited >= timeout, "gave up after {waited:?}");
    assert!(err.to_string().contains("timed out"), "{err}");
    // The connection is still usable after a timeout.
    c.set("never-set", b"now").unwrap();
    assert_eq!(c.wait_get("never-set", timeout).unwrap(), b"now");
}

#[test]
fn wait_waits_for_every_key_and_times_out_on_a_missing_one() {
    let server = server();
    let c = client(&server);
    c.set("a", b"1").unwrap();
    c.set("b", b"2").unwrap();
    c.wait(&["a", "b"], Duration::from_millis(200)).unwrap();
    let err = c
        .wait(&["a", "missing"], Duration::from_millis(200))
        .unwrap_err();
    assert!(matches!(err, CommError::Timeout { .. }), "{err:?}");
}

#[test]
fn add_counts_across_clients() {
    let server = server();
    let first = client(&server);
    assert_eq!(
        first.add("counter", 5).unwrap(),
        5,
        "an absent key counts from 0"
    );
    assert_eq!(first.add("counter", -2).unwrap(), 3);
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let c = client(&server);
            std::thread::spawn(move || {
                for _ in 0..25 {
                    c.add("counter", 1).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let second = client(&server);
    assert_eq!(second.add("counter", 0).unwrap(), 103);
    // The counter is stored as decimal text, readable with get.
    assert_eq!(second.get("counter").unwrap(), b"103");
}

#[test]
fn compare_set_swaps_only_on_the_expected_value() {
    let server = server();
    let c = client(&server);
    // Absent key, expected absent: set.
    assert_eq!(c.compare_set("leader", None, b"rank0").unwrap(), b"rank0");
    assert_eq!(c.get("leader").unwrap(), b"rank0");
    // Present key, expected absent: unchanged, the current value is returned.
    assert_eq!(c.compare_set("leader", None, b"rank1").unwrap(), b"rank0");
    assert_eq!(c.get("leader").unwrap(), b"rank0");
    // Wrong expected value: unchanged.
    assert_eq!(
        c.compare_set("leader", Some(b"rank9"), b"rank1").unwrap(),
        b"rank0"
    );
    assert_eq!(c.get("leader").unwrap(), b"rank0");
    // Right expected value: swapped.
    assert_eq!(
        c.compare_set("leader", Some(b"rank0"), b"rank1").unwrap(),
        b"rank1"
    );
    assert_eq!(c.get("leader").unwrap(), b"rank1");
    // Expecting a value on an absent key: nothing is created.
    assert_eq!(c.compare_set("ghost", Some(b"x"), b"y").unwrap(), b"");
    assert!(!c.check("ghost").unwrap());
}

#[test]
fn compare_set_races_have_one_winner() {
    let server = Arc::new(server());
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let c = client(&server);
            std::thread::spawn(move || {
                let mine = format!("claimant{i}").into_bytes();
                c.compare_set("claim", None, &mine).unwrap() == mine
            })
        })
        .collect();
    let winners = threads
        .into_iter()
        .map(|t| t.join().unwrap())
        .filter(|&won| won)
        .count();
    assert_eq!(winners, 1);
}

/// `compare_set(key, None, ..)` is documented to set only "if absent"; a key that exists
/// with an empty value is not absent and must not be overwritten.
#[test]
fn compare_set_expecting_absent_does_not_overwrite_an_empty_value() {
    let server = server();
    let c = client(&server);
    c.set("flag", b"").unwrap();
    assert!(c.check("flag").unwrap());
    let now = c.compare_set("flag", None, b"taken").unwrap();
    assert_eq!(
        c.get("flag").unwrap(),
        b"",
        "compare_set(expected: None) overwrote a present (empty) value; it returned {:?}",
        String::from_utf8_lossy(&now)
    );
}

#[test]
fn delete_and_check() {
    let server = server();
    let c = client(&server);
    assert!(!c.check("k").unwrap());
    assert!(
        !c.delete("k").unwrap(),
        "deleting an absent key reports false"
    );
    c.set("k", b"v").unwrap();
    assert!(c.check("k").unwrap());
    assert!(
        client(&server).check("k").unwrap(),
        "visible to other clients"
    );
    assert!(c.delete("k").unwrap());
    assert!(!c.check("k").unwrap());
    assert!(!c.delete("k").unwrap());
    assert_eq!(server.peek("k"), None);
    // After a delete, get waits again (and times out).
    assert!(matches!(
        c.wait_get("k", Duration::from_millis(100)),
        Err(CommError::Timeout { .. })
    ));
}

#[test]
fn wrong_secret_is_refused_and_the_right_one_still_works() {
    let server = server();
    let good = client(&server);
    good.set("before", b"1").unwrap();
    let err = match StoreClient::connect(server.addr(), "not-the-secret", CONNECT) {
        Ok(_) => panic!("a client with the wrong secret was accepted"),
        Err(e) => e,
    };
    assert!(matches!(err, CommError::Store(_)), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("refused"), "{text}");
    assert!(text.contains("secret"), "{text}");
    // An empty secret is wrong too.
    assert!(StoreClient::connect(server.addr(), "", CONNECT).is_err());
    // The existing client and a new one with the right secret still work.
    assert_eq!(good.get("before").unwrap(), b"1");
    let again = client(&server);
    again.set("after", b"2").unwrap();
    assert_eq!(good.get("after").unwrap(), b"2");
}

#[test]
fn values_are_independent_across_servers() {
    let a = server();
    let b = StoreServer::start("127.0.0.1:0", "other-secret").unwrap();
    assert_ne!(a.addr(), b.addr());
    let ca = client(&a);
    let cb = StoreClient::connect(b.addr(), "other-secret", CONNECT).unwrap();
    ca.set("shared-name", b"a").unwrap();
    assert!(!cb.check("shared-name").unwrap());
    // Each server only knows its own secret.
    assert!(StoreClient::connect(b.addr(), SECRET, CONNECT).is_err());
}
