"""The appliance's own HTTP/1.1 server: reading requests, writing answers, handing memory back after
a large body."""
