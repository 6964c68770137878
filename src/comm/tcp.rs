//! Reaching a peer over TCP that may not be listening yet: the ranks of a launched run start
//! in no particular order, so rank 0's store (or torchrun's) may come up after the others.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// How often a connection is tried again, and how long one try may take.
const RETRY: Duration = Duration::from_millis(200);
const ONE_TRY: Duration = Duration::from_secs(1);

/// A connection to `address`, tried again until one succeeds or `timeout` has passed (then
/// the last try's error).
pub fn connect_within(address: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let start = Instant::now();
    loop {
        match TcpStream::connect_timeout(&address, ONE_TRY) {
            Ok(stream) => return Ok(stream),
            Err(e) if start.elapsed() >= timeout => return Err(e),
            Err(_) => std::thread::sleep(RETRY),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn waits_for_a_listener_that_comes_late_and_gives_up_on_one_that_never_does() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let address: SocketAddr = ([127, 0, 0, 1], port).into();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            let listener = TcpListener::bind(address).unwrap();
            listener.accept().unwrap();
        });
        connect_within(address, Duration::from_secs(60)).unwrap();
        late.join().unwrap();
        let start = Instant::now();
        assert!(connect_within(address, Duration::from_millis(300)).is_err());
        assert!(start.elapsed() < Duration::from_secs(10));
    }
}
