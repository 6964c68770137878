//! The few requests smelt makes of torchrun's own store. Under torchrun, the launcher's agent
//! serves a c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT` (and says so with
//! `TORCHELASTIC_USE_AGENT_STORE=True`), so rank 0 cannot open that port for its own store;
//! instead it opens any free port and leaves its address under a key of torchrun's store,
//! where the other ranks read it.
//!
//! The requests, in c10d's encoding (native-endian integers; every machine smelt runs on is
//! little-endian): a connection starts with `VALIDATE` and the magic number; `SET key value`
//! is not answered; `WAIT 1 key` is answered by one byte once the key is set; `GET key` by
//! the value. Keys and values go as a u64 length and their bytes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::tcp::connect_within;

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const WAIT: u8 = 6;
const MAGIC: u32 = 0x3C85_F7CE;
/// `WaitResponseType::STOP_WAITING`: the key is set.
const STOP_WAITING: u8 = 0;

pub struct TorchStore {
    stream: TcpStream,
}

impl TorchStore {
    /// Connects to torchrun's store at `address`, trying for at most `timeout`.
    pub fn connect(address: SocketAddr, timeout: Duration) -> Result<TorchStore> {
        let stream = connect_within(address, timeout).with_context(|| {
            format!("cannot reach torchrun's store at {address} (MASTER_ADDR:MASTER_PORT)")
        })?;
        stream.set_read_timeout(Some(timeout))?;
        let mut store = TorchStore { stream };
        let mut hello = vec![VALIDATE];
        hello.extend(MAGIC.to_le_bytes());
        store.send(&hello)?;
        Ok(store)
    }

    /// This end's address on the connection: an address of this machine that reaches the
    /// store's, and so, as a rule, one that the other machines of the run reach too.
    pub fn local_ip(&self) -> Result<std::net::IpAddr> {
        Ok(self.stream.local_addr()?.ip())
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let mut request = vec![SET];
        put(&mut request, key.as_bytes());
        put(&mut request, value);
        self.send(&request)
    }

    /// The value of `key`, once some rank has set it (waiting at most the read timeout).
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>> {
        let mut wait = vec![WAIT];
        wait.extend(1u64.to_le_bytes());
        put(&mut wait, key.as_bytes());
        self.send(&wait)?;
        let mut answer = [0];
        self.stream
            .read_exact(&mut answer)
            .with_context(|| format!("torchrun's store: waiting for `{key}`"))?;
        if answer[0] != STOP_WAITING {
            bail!(
                "torchrun's store: waiting for `{key}` was answered {}",
                answer[0]
            );
        }
        let mut get = vec![GET];
        put(&mut get, key.as_bytes());
        self.send(&get)?;
        let mut len = [0; 8];
        self.stream.read_exact(&mut len)?;
        let len = u64::from_le_bytes(len);
        if len > 1 << 20 {
            bail!("torchrun's store: `{key}` holds {len} bytes, not an address");
        }
        let mut value = vec![0; len as usize];
        self.stream.read_exact(&mut value)?;
        Ok(value)
    }

    fn send(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream
            .write_all(bytes)
            .context("writing to torchrun's store")
    }
}

fn put(request: &mut Vec<u8>, bytes: &[u8]) {
    request.extend((bytes.len() as u64).to_le_bytes());
    request.extend(bytes);
}

/// A stand-in for torchrun's store, for tests: it reads requests as c10d's `TCPStore` does
/// (`TCPStoreLibUvBackend`'s `parse_*_command`s, magic number included) and answers as it
/// does, keeping the keys in memory.
#[cfg(test)]
pub fn serve_like_c10d() -> SocketAddr {
    use std::collections::HashMap;
    use std::net::TcpListener;
    use std::sync::{Arc, Condvar, Mutex};

    fn bytes(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
        let mut n = [0; 8];
        s.read_exact(&mut n)?;
        let mut b = vec![0; u64::from_le_bytes(n) as usize];
        s.read_exact(&mut b)?;
        Ok(b)
    }
    type Keys = (Mutex<HashMap<Vec<u8>, Vec<u8>>>, Condvar);

    fn serve(mut s: TcpStream, keys: &Keys) -> std::io::Result<()> {
        let mut hello = [0; 5];
        s.read_exact(&mut hello)?;
        assert_eq!(hello, [VALIDATE, 0xCE, 0xF7, 0x85, 0x3C]);
        let mut request = [0];
        while s.read_exact(&mut request).is_ok() {
            let (map, set) = keys;
            match request[0] {
                SET => {
                    let (k, v) = (bytes(&mut s)?, bytes(&mut s)?);
                    map.lock().unwrap().insert(k, v);
                    set.notify_all();
                }
                WAIT => {
                    let mut count = [0; 8];
                    s.read_exact(&mut count)?;
                    assert_eq!(u64::from_le_bytes(count), 1);
                    let k = bytes(&mut s)?;
                    drop(
                        set.wait_while(map.lock().unwrap(), |m| !m.contains_key(&k))
                            .unwrap(),
                    );
                    s.write_all(&[STOP_WAITING])?;
                }
                GET => {
                    let v = map.lock().unwrap()[&bytes(&mut s)?].clone();
                    s.write_all(&(v.len() as u64).to_le_bytes())?;
                    s.write_all(&v)?;
                }
                other => panic!("request {other}, which smelt does not make"),
            }
        }
        Ok(())
    }
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    let keys = Arc::new((Mutex::new(HashMap::new()), Condvar::new()));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let keys = keys.clone();
            std::thread::spawn(move || serve(stream.unwrap(), &keys));
        }
    });
    address
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_set_by_one_connection_is_got_by_another_that_waited_for_it() {
        let address = serve_like_c10d();
        let timeout = Duration::from_secs(60);
        let mut reader = TorchStore::connect(address, timeout).unwrap();
        let waiting = std::thread::spawn(move || reader.get("smelt/store/0").unwrap());
        std::thread::sleep(Duration::from_millis(50));
        let mut writer = TorchStore::connect(address, timeout).unwrap();
        writer.set("smelt/store/0", b"10.0.0.1:4242").unwrap();
        assert_eq!(waiting.join().unwrap(), b"10.0.0.1:4242");
    }
}
