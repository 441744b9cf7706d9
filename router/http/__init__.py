"""The router's HTTP surface: the app, the proxy to workers, failover and metrics.

``app`` serves the OpenAI endpoints and the admin and debug surface; ``proxy`` forwards a
decided request to its worker over ``upstream``'s kept-alive connections (hosts looked up
through ``resolver``); ``failover`` retries elsewhere before the first byte;
``first_byte`` times that deadline; ``metrics`` exports the router's Prometheus families.
"""
