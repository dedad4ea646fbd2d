use super::*;
use crate::metrics::Metrics;
use crate::plan::permutation;

fn cache(capacity: u64, policy: CachePolicy) -> Arc<Cache> {
    Cache::new(capacity, policy, Metrics::new().cache.clone())
}

fn key(source: &Arc<str>, name: &str, size: u64) -> SampleKey {
    SampleKey {
        source: Arc::clone(source),
        name: name.into(),
        version: 1,
        size,
    }
}

/// Looks `key` up and, on a miss, fills it with `size` bytes of `fill`;
/// returns whether it hit.
fn read(c: &Arc<Cache>, dataset: &str, key: &SampleKey, fill: u8) -> bool {
    match c.lookup(dataset, key) {
        Lookup::Hit(bytes) => {
            assert_eq!(bytes.len() as u64, key.size);
            true
        }
        Lookup::Miss(f) => {
            f.complete(&vec![fill; key.size as usize]);
            false
        }
        Lookup::Wait(_) => panic!("nothing else reads"),
    }
}

/// Hits over `epochs` epochs of `n` samples of `size` bytes in a fresh
/// random order each, after a first epoch that fills the cache.
fn hits_per_epoch(policy: CachePolicy, capacity: u64, n: u32, size: u64, epochs: u64) -> Vec<u32> {
    let c = cache(capacity, policy);
    let src: Arc<str> = "/data".into();
    (0..=epochs)
        .map(|epoch| {
            permutation(n, 7, epoch, true)
                .into_iter()
                .filter(|&i| read(&c, "d", &key(&src, &format!("f{i}"), size), 0))
                .count() as u32
        })
        .collect()
}

#[test]
fn a_hit_returns_the_bytes_and_a_new_version_misses() {
    let c = cache(1 << 20, CachePolicy::Stable);
    let src: Arc<str> = "/data".into();
    let k = key(&src, "a", 3);
    assert!(!read(&c, "d", &k, 7));
    let Lookup::Hit(bytes) = c.lookup("d", &k) else {
        panic!("admitted");
    };
    assert_eq!(&bytes[..], &[7, 7, 7]);
    let changed = SampleKey { version: 2, ..k };
    assert!(!read(&c, "d", &changed, 8), "a new version is a new key");
}

#[test]
fn a_data_set_that_fits_hits_every_read_after_the_first_epoch() {
    let hits = hits_per_epoch(CachePolicy::Stable, 100 * 10, 100, 10, 3);
    assert_eq!(hits, vec![0, 100, 100, 100]);
}

#[test]
fn the_stable_policy_keeps_its_subset_and_hits_the_optimum_where_lru_thrashes() {
    // A quarter of the data set fits: the best any cache can do under
    // random order is 25% of reads.
    let (n, size) = (2000, 10);
    let stable = hits_per_epoch(CachePolicy::Stable, 500 * size, n, size, 4);
    assert_eq!(
        &stable[1..],
        &[500, 500, 500, 500],
        "exactly the subset, every epoch"
    );
    let lru = hits_per_epoch(CachePolicy::Lru, 500 * size, n, size, 4);
    let lru_mean = lru[1..].iter().sum::<u32>() as f64 / 4.0;
    assert!(
        lru_mean < 0.8 * 500.0,
        "LRU hit {lru:?}, about chance or below"
    );
}

#[test]
fn a_second_data_set_takes_its_share_from_the_first() {
    let c = cache(100, CachePolicy::Stable);
    let (a, b): (Arc<str>, Arc<str>) = ("/a".into(), "/b".into());
    for i in 0..10 {
        read(&c, "a", &key(&a, &format!("f{i}"), 10), 0);
    }
    assert_eq!(c.usage()[0].bytes, 100, "a alone may fill the cache");
    for i in 0..10 {
        read(&c, "b", &key(&b, &format!("f{i}"), 10), 0);
    }
    let usage = c.usage();
    assert_eq!((usage[0].bytes, usage[1].bytes), (50, 50), "{usage:?}");
    // a kept its oldest half: the subset it already had.
    for i in 0..5 {
        assert!(read(&c, "a", &key(&a, &format!("f{i}"), 10), 0), "f{i}");
    }
    // Weights split the cache unevenly.
    c.set_weight(&a, "a", 3);
    for i in 5..10 {
        read(&c, "a", &key(&a, &format!("f{i}"), 10), 0);
    }
    let usage = c.usage();
    assert_eq!((usage[0].bytes, usage[1].bytes), (70, 30), "{usage:?}");
}

#[test]
fn a_sample_larger_than_the_cache_is_passed_through() {
    let c = cache(10, CachePolicy::Stable);
    let src: Arc<str> = "/data".into();
    assert!(!read(&c, "d", &key(&src, "big", 11), 0));
    assert!(!read(&c, "d", &key(&src, "big", 11), 0));
    assert_eq!(c.usage()[0].entries, 0);
}

#[test]
fn concurrent_misses_of_one_sample_share_one_read() {
    let c = cache(1 << 20, CachePolicy::Stable);
    let src: Arc<str> = "/data".into();
    let k = key(&src, "a", 4);
    let Lookup::Miss(fill) = c.lookup("d", &k) else {
        panic!("first lookup misses");
    };
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let Lookup::Wait(flight) = c.lookup("d", &k) else {
                panic!("a read is in flight");
            };
            std::thread::spawn(move || flight.wait_blocking())
        })
        .collect();
    let Lookup::Wait(flight) = c.lookup("d", &k) else {
        panic!("a read is in flight");
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let waited = runtime.spawn(async move { flight.wait().await });
    fill.complete(&[1, 2, 3, 4]);
    for w in waiters {
        assert_eq!(&w.join().unwrap().unwrap()[..], &[1, 2, 3, 4]);
    }
    assert_eq!(
        &runtime.block_on(waited).unwrap().unwrap()[..],
        &[1, 2, 3, 4]
    );
}

#[test]
fn a_failed_read_fails_its_waiters_and_leaves_nothing_pending() {
    let c = cache(1 << 20, CachePolicy::Stable);
    let src: Arc<str> = "/data".into();
    let k = key(&src, "a", 4);
    let Lookup::Miss(fill) = c.lookup("d", &k) else {
        panic!("first lookup misses");
    };
    let Lookup::Wait(flight) = c.lookup("d", &k) else {
        panic!("a read is in flight");
    };
    fill.fail(&ProtocolError::new(ErrorCode::NotFound, "gone"));
    assert_eq!(
        flight.wait_blocking().unwrap_err().code,
        ErrorCode::NotFound
    );
    assert!(
        matches!(c.lookup("d", &k), Lookup::Miss(_)),
        "nothing pending any more"
    );
}
