//! [`ShardBytes`]: a stage's serialised state, owned by whoever made it. A backend linked into
//! the process hands over its `Vec`; a plugin hands over the buffer it allocated, which the
//! host reads in place and gives back to the plugin when the bytes are dropped, so a 0.9B
//! checkpoint's 10.5 GB cross the plugin boundary without a copy.

use std::fmt;
use std::ops::Deref;

/// Serialised bytes ([`crate::StageSnapshot::bytes`]): a host `Vec`, or a buffer owned
/// elsewhere (a plugin's) that is released when this is dropped.
pub struct ShardBytes(Inner);

enum Inner {
    Vec(Vec<u8>),
    Owned(Box<dyn AsRef<[u8]> + Send + Sync>),
}

impl ShardBytes {
    /// Bytes whose owner `buf` frees them when dropped (read in place, never copied).
    pub fn owned(buf: impl AsRef<[u8]> + Send + Sync + 'static) -> Self {
        ShardBytes(Inner::Owned(Box::new(buf)))
    }

    /// The bytes as a `Vec`: the one it is, or a copy of a buffer owned elsewhere.
    pub fn into_vec(self) -> Vec<u8> {
        match self.0 {
            Inner::Vec(v) => v,
            Inner::Owned(b) => (*b).as_ref().to_vec(),
        }
    }
}

impl From<Vec<u8>> for ShardBytes {
    fn from(v: Vec<u8>) -> Self {
        ShardBytes(Inner::Vec(v))
    }
}

impl Deref for ShardBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Inner::Vec(v) => v,
            Inner::Owned(b) => (**b).as_ref(),
        }
    }
}

impl AsRef<[u8]> for ShardBytes {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl PartialEq for ShardBytes {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl fmt::Debug for ShardBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.0 {
            Inner::Vec(_) => "host",
            Inner::Owned(_) => "owned",
        };
        write!(f, "ShardBytes({} bytes, {kind})", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Counted(Vec<u8>, Arc<AtomicUsize>);
    impl AsRef<[u8]> for Counted {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }
    impl Drop for Counted {
        fn drop(&mut self) {
            self.1.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn owned_bytes_are_read_in_place_and_released_once() {
        let freed = Arc::new(AtomicUsize::new(0));
        let b = ShardBytes::owned(Counted(vec![1, 2, 3], freed.clone()));
        assert_eq!(&*b, &[1, 2, 3]);
        assert_eq!(b, ShardBytes::from(vec![1, 2, 3]));
        assert_eq!(freed.load(Ordering::SeqCst), 0);
        assert_eq!(b.into_vec(), vec![1, 2, 3]);
        assert_eq!(
            freed.load(Ordering::SeqCst),
            1,
            "into_vec copies, then releases"
        );
    }

    #[test]
    fn a_vec_is_handed_back_without_a_copy() {
        let v = vec![7u8; 1000];
        let ptr = v.as_ptr();
        let b = ShardBytes::from(v);
        assert_eq!(b.as_ptr(), ptr);
        let back = b.into_vec();
        assert_eq!(back.as_ptr(), ptr);
    }
}
