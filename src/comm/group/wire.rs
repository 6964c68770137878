//! The messages between a `Remote` rank and rank 0's `Store`, and their encoding: a tag byte,
//! then the fields, integers as little-endian u64, a string as its length and UTF-8 bytes,
//! a list of values as its length and the f64s' little-endian bits (so values arrive exactly
//! as they left). Every message a side sends is answered, if at all, in the order sent.

use std::io::{self, Read, Write};

use super::Failure;

/// Opens a rank's first message, so that a store that is reached by something else (or by
/// another build of smelt, whose messages may differ) says so instead of misreading it.
const HELLO: &[u8; 8] = b"smelt\x00\x01\x00";

/// The longest list or string a message may carry: far more than any model's tensors, and
/// small enough that a corrupt length cannot make the reader allocate without bound.
const MAX_LEN: u64 = 1 << 36;

/// What a rank sends to the store.
#[derive(Debug, PartialEq)]
pub enum ToStore {
    /// The first message: which rank this is, of how many.
    Hello { rank: usize, world: usize },
    /// `Group::exchange`.
    Exchange(Vec<f64>),
    /// `Group::fail`, with the rank's error.
    Fail(String),
    /// `Group::end`.
    End,
}

/// What the store sends to a rank.
#[derive(Debug, PartialEq)]
pub enum FromStore {
    /// The rank is one of the group.
    Welcome,
    /// The rank is not (another rank of that number came, or the world sizes differ).
    Refused(String),
    /// The answer to `Exchange`: every rank's values, in rank order.
    Exchanged(Vec<Vec<f64>>),
    /// The answer to an `Exchange` that failed at the store (a rank did not come in time).
    ExchangeFailed(String),
    /// The group failed, told as soon as it does, whether or not the rank is at a meeting.
    Failed(Failure),
}

impl ToStore {
    pub fn send(&self, w: &mut impl Write) -> io::Result<()> {
        match self {
            ToStore::Hello { rank, world } => {
                w.write_all(HELLO)?;
                put_u64(w, *rank as u64)?;
                put_u64(w, *world as u64)?;
            }
            ToStore::Exchange(values) => {
                w.write_all(&[1])?;
                put_values(w, values)?;
            }
            ToStore::Fail(message) => {
                w.write_all(&[2])?;
                put_str(w, message)?;
            }
            ToStore::End => w.write_all(&[3])?,
        }
        w.flush()
    }

    /// Reads the first message of a rank: its `Hello`.
    pub fn receive_hello(r: &mut impl Read) -> io::Result<ToStore> {
        let mut magic = [0; HELLO.len()];
        r.read_exact(&mut magic)?;
        if &magic != HELLO {
            return Err(invalid(
                "not a smelt rank (or one of another version of smelt)",
            ));
        }
        Ok(ToStore::Hello {
            rank: get_u64(r)? as usize,
            world: get_u64(r)? as usize,
        })
    }

    /// Reads any message after the `Hello`.
    pub fn receive(r: &mut impl Read) -> io::Result<ToStore> {
        Ok(match get_u8(r)? {
            1 => ToStore::Exchange(get_values(r)?),
            2 => ToStore::Fail(get_str(r)?),
            3 => ToStore::End,
            tag => return Err(invalid(&format!("unknown message {tag} from a rank"))),
        })
    }
}

impl FromStore {
    pub fn send(&self, w: &mut impl Write) -> io::Result<()> {
        match self {
            FromStore::Welcome => w.write_all(&[0])?,
            FromStore::Refused(message) => {
                w.write_all(&[1])?;
                put_str(w, message)?;
            }
            FromStore::Exchanged(all) => {
                send_exchanged(w, all)?;
                return Ok(());
            }
            FromStore::ExchangeFailed(message) => {
                w.write_all(&[3])?;
                put_str(w, message)?;
            }
            FromStore::Failed(Failure::Rank { rank, message }) => {
                w.write_all(&[4])?;
                put_u64(w, *rank as u64)?;
                put_str(w, message)?;
            }
            FromStore::Failed(Failure::Stalled) => w.write_all(&[5])?,
        }
        w.flush()
    }

    pub fn receive(r: &mut impl Read) -> io::Result<FromStore> {
        Ok(match get_u8(r)? {
            0 => FromStore::Welcome,
            1 => FromStore::Refused(get_str(r)?),
            2 => {
                let ranks = get_len(r)?;
                FromStore::Exchanged(
                    (0..ranks)
                        .map(|_| get_values(r))
                        .collect::<Result<_, _>>()?,
                )
            }
            3 => FromStore::ExchangeFailed(get_str(r)?),
            4 => FromStore::Failed(Failure::Rank {
                rank: get_u64(r)? as usize,
                message: get_str(r)?,
            }),
            5 => FromStore::Failed(Failure::Stalled),
            tag => return Err(invalid(&format!("unknown message {tag} from the store"))),
        })
    }
}

/// `FromStore::Exchanged` from the lists as the group holds them, without copying them.
pub fn send_exchanged(w: &mut impl Write, all: &[Vec<f64>]) -> io::Result<()> {
    w.write_all(&[2])?;
    put_u64(w, all.len() as u64)?;
    for values in all {
        put_values(w, values)?;
    }
    w.flush()
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

fn put_u64(w: &mut impl Write, v: u64) -> io::Result<()> {
    w.write_all(&v.to_le_bytes())
}

fn put_str(w: &mut impl Write, s: &str) -> io::Result<()> {
    put_u64(w, s.len() as u64)?;
    w.write_all(s.as_bytes())
}

fn put_values(w: &mut impl Write, values: &[f64]) -> io::Result<()> {
    put_u64(w, values.len() as u64)?;
    values
        .iter()
        .try_for_each(|v| w.write_all(&v.to_bits().to_le_bytes()))
}

fn get_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn get_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn get_len(r: &mut impl Read) -> io::Result<usize> {
    match get_u64(r)? {
        n if n <= MAX_LEN => Ok(n as usize),
        n => Err(invalid(&format!("a message claims {n} items"))),
    }
}

fn get_str(r: &mut impl Read) -> io::Result<String> {
    let mut bytes = vec![0; get_len(r)?];
    r.read_exact(&mut bytes)?;
    String::from_utf8(bytes).map_err(|_| invalid("a message's text is not UTF-8"))
}

fn get_values(r: &mut impl Read) -> io::Result<Vec<f64>> {
    let mut bytes = vec![0; get_len(r)? * 8];
    r.read_exact(&mut bytes)?;
    Ok(bytes
        .chunks_exact(8)
        .map(|b| f64::from_bits(u64::from_le_bytes(b.try_into().expect("8 bytes"))))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_reads_back_as_sent() {
        let to = [
            ToStore::Exchange(vec![1.5, -0.0, f64::MAX, f64::MIN_POSITIVE / 3.0]),
            ToStore::Exchange(vec![]),
            ToStore::Fail("rank 1: out of memory".into()),
            ToStore::End,
        ];
        let mut bytes = vec![];
        ToStore::Hello { rank: 3, world: 8 }
            .send(&mut bytes)
            .unwrap();
        for m in &to {
            m.send(&mut bytes).unwrap();
        }
        let mut r = bytes.as_slice();
        assert_eq!(
            ToStore::receive_hello(&mut r).unwrap(),
            ToStore::Hello { rank: 3, world: 8 }
        );
        for m in &to {
            assert_eq!(&ToStore::receive(&mut r).unwrap(), m);
        }
        assert!(r.is_empty());

        let from = [
            FromStore::Welcome,
            FromStore::Refused("rank 1 joined twice".into()),
            FromStore::Exchanged(vec![vec![1.0, 2.0], vec![], vec![f64::NAN.copysign(-1.0)]]),
            FromStore::ExchangeFailed("rank 0 waited".into()),
            FromStore::Failed(Failure::Rank {
                rank: 2,
                message: "killed".into(),
            }),
            FromStore::Failed(Failure::Stalled),
        ];
        let mut bytes = vec![];
        for m in &from {
            m.send(&mut bytes).unwrap();
        }
        let mut r = bytes.as_slice();
        for m in &from {
            let got = FromStore::receive(&mut r).unwrap();
            // NaN is not equal to itself: compare the exchanged values' bits.
            match (&got, m) {
                (FromStore::Exchanged(a), FromStore::Exchanged(b)) => {
                    let bits = |v: &Vec<Vec<f64>>| -> Vec<Vec<u64>> {
                        v.iter()
                            .map(|l| l.iter().map(|x| x.to_bits()).collect())
                            .collect()
                    };
                    assert_eq!(bits(a), bits(b));
                }
                _ => assert_eq!(&got, m),
            }
        }
        assert!(r.is_empty());
    }

    #[test]
    fn a_stranger_or_a_corrupt_length_is_refused_without_allocating() {
        let mut r: &[u8] = b"GET / HTTP/1.1\r\n";
        let err = ToStore::receive_hello(&mut r).unwrap_err();
        assert!(err.to_string().contains("not a smelt rank"), "{err}");
        let mut bytes = vec![1];
        bytes.extend(u64::MAX.to_le_bytes());
        let err = ToStore::receive(&mut bytes.as_slice()).unwrap_err();
        assert!(err.to_string().contains("claims"), "{err}");
    }
}
