"""PostgreSQL: the pool, the migrations, and one store per table family. Only the executor store writes executors."""
