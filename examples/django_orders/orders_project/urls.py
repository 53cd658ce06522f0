from django.urls import path
from orders.views import create_order, resend_confirmation

urlpatterns = [
    path("orders/", create_order),
    path("orders/<int:order_id>/confirmation/", resend_confirmation),
]
