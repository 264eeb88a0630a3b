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

/// A server that is not a Lockstep store (torchrun's TCPStore on `MASTER_PORT`, any other
/// service): one that reads and never answers, and one that answers with other bytes.
#[test]
fn a_foreign_server_is_named_not_a_lockstep_store() {
    use std::io::{Read, Write};
    for answers in [false, true] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut buf = [0u8; 64];
            let _ = conn.read(&mut buf);
            if answers {
                let _ = conn.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
            } else {
                std::thread::sleep(Duration::from_secs(7));
            }
        });
        let started = Instant::now();
        let err = match StoreClient::connect(addr, SECRET, CONNECT) {
            Ok(_) => panic!("a foreign server was taken for a store"),
            Err(e) => e,
        };
        let text = err.to_string();
        assert!(text.contains("is not a Lockstep store"), "{text}");
        assert!(text.contains("LOCKSTEP_STORE_PORT"), "{text}");
        assert!(!text.contains("wrong run secret"), "{text}");
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "{:?}",
            started.elapsed()
        );
        if answers {
            server.join().unwrap();
        }
    }
}

/// The client's local address is the interface that reaches the store (what a rank
/// publishes for its peers by default).
#[test]
fn the_client_knows_its_local_address() {
    let server = server();
    let c = client(&server);
    let local = c
        .local_addr()
        .expect("connected socket has a local address");
    assert!(local.ip().is_loopback(), "{local}");
}

mod rendezvous {
    use lockstep_core::comm::{host_identity, ExternalLaunch, InitOptions, StoreServer, World};
    use std::collections::HashMap;
    use std::time::{Duration, Instant};

    /// A rank that never arrives is named within the rendezvous timeout, not the (much
    /// longer) collective timeout.
    #[test]
    fn a_missing_rank_is_named_within_the_rendezvous_timeout() {
        let store = StoreServer::start("127.0.0.1:0", "s").unwrap();
        let mut opts = InitOptions::local(0, 3, store.addr().to_string(), "s");
        opts.rendezvous_timeout = Duration::from_millis(500);
        opts.timeout = Duration::from_secs(600);
        let other = {
            let mut o = opts.clone();
            o.rank = 1;
            o
        };
        let one = std::thread::spawn(move || World::init(other).map(|_| ()));
        let started = Instant::now();
        let err = match World::init(opts) {
            Ok(_) => panic!("a world with a missing rank was built"),
            Err(e) => e.to_string(),
        };
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(err.contains("rank(s) [2] of 3"), "{err}");
        let err1 = one
            .join()
            .unwrap()
            .expect_err("rank 1 fails too")
            .to_string();
        assert!(err1.contains("rank(s) [2] of 3"), "{err1}");
    }

    /// Ranks that joined one run for different tests are told so, with both names.
    #[test]
    fn ranks_running_different_tests_are_named() {
        let store = StoreServer::start("127.0.0.1:0", "s").unwrap();
        let opts = |rank: usize, label: &str| {
            let mut o = InitOptions::local(rank, 2, store.addr().to_string(), "s");
            o.run_label = label.into();
            o.rendezvous_timeout = Duration::from_secs(10);
            o
        };
        let b = opts(1, "test_b");
        let other = std::thread::spawn(move || World::init(b).map(|_| ()));
        let err = World::init(opts(0, "test_a"))
            .err()
            .expect("labels differ")
            .to_string();
        assert!(
            err.contains("\"test_b\"") && err.contains("\"test_a\""),
            "{err}"
        );
        assert!(other.join().unwrap().is_err());
    }

    #[test]
    fn torchrun_moves_the_store_off_master_port() {
        let vars = |extra: &[(&str, &str)]| {
            let mut m: HashMap<String, String> = [
                ("RANK", "1"),
                ("WORLD_SIZE", "4"),
                ("MASTER_ADDR", "10.0.0.1"),
                ("MASTER_PORT", "29500"),
            ]
            .iter()
            .chain(extra)
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
            for (k, v) in extra {
                m.insert(k.to_string(), v.to_string());
            }
            m
        };
        let plain = vars(&[]);
        let launch = ExternalLaunch::from_vars(|k| plain.get(k).cloned(), false).unwrap();
        assert_eq!((launch.store_port, launch.local_rank), (29500, 0));
        assert_eq!(launch.store_bind(), "0.0.0.0:29500");
        let launch = ExternalLaunch::from_vars(|k| plain.get(k).cloned(), true).unwrap();
        assert_eq!(launch.store_port, 29501);
        let chosen = vars(&[("LOCKSTEP_STORE_PORT", "31000")]);
        let launch = ExternalLaunch::from_vars(|k| chosen.get(k).cloned(), true).unwrap();
        assert_eq!(launch.store_port, 31000);
        let bad = vars(&[("MASTER_PORT", "http")]);
        let err = ExternalLaunch::from_vars(|k| bad.get(k).cloned(), true).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"), "{err}");
    }

    #[test]
    fn host_identity_includes_the_network_namespace() {
        let id = host_identity();
        if std::path::Path::new("/proc/self/ns/net").exists() {
            assert!(id.contains("net:["), "{id}");
        }
    }
}
