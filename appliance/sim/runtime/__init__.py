"""What runs simulated engines in time: the clocks and the live loop, one worker (engine,
loop, KV events, metrics) and its sleep mode, and the virtual-time driver with what
its routes see, its decode stretches and Mooncake traces as arrivals."""
